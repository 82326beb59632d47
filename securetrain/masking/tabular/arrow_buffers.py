"""Zero-copy numpy views of an Arrow string or binary array's buffers.

One place for the offsets/bytes view that the transforms, the detectors and the token MAC paths
(helper processes, DataFusion partitions) all read.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def offsets_and_data(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The value offsets (n + 1, int64, rebased to 0) and the bytes of a string or binary array
    (32- or 64-bit offsets); the bytes are a view, not a copy."""
    n = len(arr)
    wide = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    item = 8 if wide else 4
    _, offs_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offs_buf, dtype=np.int64 if wide else np.int32, count=n + 1,
                            offset=arr.offset * item).astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    data = (np.frombuffer(data_buf, dtype=np.uint8, count=end - start, offset=start)
            if data_buf is not None and end > start else np.zeros(0, dtype=np.uint8))
    return offsets - start, data


def is_ascii(data: np.ndarray) -> bool:
    """Every byte is ASCII (``data`` from :func:`offsets_and_data`): then code points are bytes and
    the cheaper ASCII kernels (``ascii_lower``, ``binary_length``) give the UTF-8 kernels' results."""
    return data.size == 0 or int(data.max()) < 0x80

"""A pass-through reader that shows every chunk it returns to an observer (a hash, a progress bar).

The stream code reads with ``readinto`` into preallocated buffers, so the tap sees a memoryview of
exactly the bytes read and never copies them.
"""

from __future__ import annotations

import io
from collections.abc import Callable


class TappedReader:
    def __init__(self, raw: io.BufferedIOBase, on_data: Callable[[bytes | memoryview], object]) -> None:
        self.raw = raw
        self.on_data = on_data

    def readinto(self, view: memoryview) -> int:
        n = self.raw.readinto(view) or 0
        if n:
            self.on_data(view[:n])
        return n

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.on_data(data)
        return data

    def seekable(self) -> bool:
        return self.raw.seekable()

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, *args: int) -> int:
        return self.raw.seek(*args)

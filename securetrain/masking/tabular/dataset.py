"""A torch Dataset that masks on load, so unmasked values never reach the model.

The file is read and masked once in ``__init__``; only the masked, encoded tensors are kept
(not the raw table, not the key), so what DataLoader workers receive is already safe.

Feature encoding (in output column order, target excluded):

* integer / float / bool columns -> one float32 each (nulls -> 0.0; bool -> 0/1);
* date / timestamp columns kept by the policy -> days since 1970-01-01 as float32;
* every other column (strings: tokens, bin labels like "[1000,5000)", months like "2023-04",
  kept categories) -> ``n_buckets`` one-hot dims via the hashing trick:
  bucket = first 8 bytes (big-endian) of sha256(column name || 0x00 || value) mod n_buckets.
  The values are already masked, so an unkeyed hash reveals nothing new. Nulls -> all zeros.

The label comes from ``target``: integers/bools -> int64; floats -> float32; strings -> int64
indices into ``class_names`` (sorted distinct values).

Types are those of the masked table, except for columns of a CSV, which masking keeps as the text
in the file (``01234`` stays ``01234``): they are typed here, as pyarrow's CSV reader infers them
(:func:`securetrain.masking.tabular.csvtext.infer_table`), so a CSV's numeric columns are numbers.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset

from securetrain.masking.tabular.csvtext import infer_table
from securetrain.masking.tabular.errors import TabularMaskingError
from securetrain.masking.tabular.masker import MaskReport, TabularMasker


def _bucket_ids(arr: pa.Array, column: str, n_buckets: int) -> np.ndarray:
    enc = pc.dictionary_encode(arr if not isinstance(arr, pa.ChunkedArray) else arr.combine_chunks())
    prefix = column.encode("utf-8") + b"\x00"
    lut = np.array(
        [int.from_bytes(hashlib.sha256(prefix + str(v).encode("utf-8")).digest()[:8], "big") % n_buckets
         for v in enc.dictionary.to_pylist()] + [-1],
        dtype=np.int64,
    )
    idx = pc.fill_null(enc.indices, len(lut) - 1).to_numpy(zero_copy_only=False)
    return lut[idx]


class TabularDataset(Dataset):
    """Yields ``{"features": float32[n_features], "label": tensor}`` from a masked table."""

    def __init__(
        self,
        source: str | os.PathLike[str] | pa.Table,
        masker: TabularMasker,
        *,
        target: str,
        features: list[str] | None = None,
        n_buckets: int = 16,
    ) -> None:
        if n_buckets < 1:
            raise ValueError("n_buckets must be >= 1")
        if isinstance(source, pa.Table):
            table, report = masker.mask_table_with_report(source)
        else:
            table, report = masker.read_masked(source)
        self.report: MaskReport = report
        if target not in table.column_names:
            raise TabularMaskingError(
                f"target column {target!r} is not in the masked table (dropped or missing)",
                hint="give the target a 'keep' rule in the policy",
            )
        names = features if features is not None else [c for c in table.column_names if c != target]
        unknown = [c for c in names if c not in table.column_names]
        if unknown:
            raise TabularMaskingError(f"feature column(s) not in the masked table: {', '.join(unknown)}")
        table = infer_table(table, [*names, target])  # a CSV's kept text -> the types of its values
        blocks: list[np.ndarray] = []
        self.feature_names: list[str] = []
        for name in names:
            col = table.column(name)
            t = col.type
            if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
                v = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
                blocks.append(np.nan_to_num(v, nan=0.0)[:, None])
                self.feature_names.append(name)
            elif pa.types.is_date(t) or pa.types.is_timestamp(t):
                days = pc.cast(pc.cast(col, pa.date32()), pa.int32()).to_numpy(zero_copy_only=False)
                blocks.append(np.nan_to_num(days.astype(np.float64), nan=0.0)[:, None])
                self.feature_names.append(name)
            else:
                ids = _bucket_ids(pc.cast(col, pa.string()), name, n_buckets)
                onehot = np.zeros((len(ids), n_buckets), dtype=np.float32)
                rows = np.nonzero(ids >= 0)[0]
                onehot[rows, ids[rows]] = 1.0
                blocks.append(onehot)
                self.feature_names.extend(f"{name}#{b}" for b in range(n_buckets))
        n = table.num_rows
        matrix = np.concatenate(blocks, axis=1) if blocks else np.zeros((n, 0))
        self.features = torch.from_numpy(np.ascontiguousarray(matrix, dtype=np.float32))
        self.class_names: list[str] | None = None
        self.labels = self._labels(table.column(target))

    def _labels(self, col: pa.ChunkedArray) -> torch.Tensor:
        if col.null_count:
            raise TabularMaskingError(f"target column has {col.null_count} null value(s)")
        t = col.type
        if pa.types.is_integer(t) or pa.types.is_boolean(t):
            return torch.from_numpy(pc.cast(col, pa.int64()).to_numpy(zero_copy_only=False).copy())
        if pa.types.is_floating(t):
            values = pc.cast(col, pa.float32()).to_numpy(zero_copy_only=False).copy()
            bad = int((~np.isfinite(values)).sum())
            if bad:  # NaN (pandas' missing value in a float column) or infinity: no label to learn
                raise TabularMaskingError(f"target column has {bad} NaN or infinite value(s)",
                                          hint="drop those rows or fill the target before masking")
            return torch.from_numpy(values)
        s = pc.cast(col, pa.string())
        self.class_names = sorted(pc.unique(s).to_pylist())
        idx = pc.index_in(s, value_set=pa.array(self.class_names, pa.string()))
        return torch.from_numpy(idx.to_numpy(zero_copy_only=False).astype(np.int64))

    @property
    def n_features(self) -> int:
        return int(self.features.shape[1])

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"features": self.features[index], "label": self.labels[index]}

"""Policy-driven masking of CSV/Parquet tables (pyarrow): tokenise, redact, generalise, drop, keep.

Names are resolved lazily so importing ``securetrain.masking.tabular.cli`` (for ``--help``)
does not pull in pyarrow or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TabularMasker": "masker", "MaskReport": "masker", "ColumnReport": "masker",
    "MaskingPolicy": "policy", "load_policy": "policy",
    "TabularDataset": "dataset",
    "generate_finance_table": "synthetic", "write_finance_file": "synthetic",
    "TabularMaskingError": "errors", "MaskKeyError": "errors", "UnmaskedColumnError": "errors",
    "PIIDetectedError": "errors", "MalformedTableError": "errors", "UnsupportedFormatError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

"""Policy-driven masking of CSV/Parquet tables (pyarrow): tokenise, redact, generalise, drop, keep.

Names are resolved lazily so importing ``securetrain.masking.tabular.cli`` (for ``--help``)
does not pull in pyarrow or torch.
"""

from __future__ import annotations

from securetrain._lazy import lazy_exports


_EXPORTS = {
    "TabularMasker": "masker", "MaskReport": "masker", "ColumnReport": "masker",
    "MaskingPolicy": "policy", "load_policy": "policy",
    "TabularDataset": "dataset",
    "generate_finance_table": "synthetic", "write_finance_file": "synthetic",
    "TabularMaskingError": "errors", "MaskKeyError": "errors", "UnmaskedColumnError": "errors",
    "PIIDetectedError": "errors", "MalformedTableError": "errors", "UnsupportedFormatError": "errors",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)

"""Typed errors for tabular masking. Messages name columns, rules and counts, never cell values."""

from __future__ import annotations

from securetrain.errors import ConfigError, SecureTrainError


class TabularMaskingError(SecureTrainError):
    """Base class for refusals and failures while masking a table."""


class MaskKeyError(TabularMaskingError, ConfigError):
    """The tokenisation key is missing, malformed or too short."""


class UnmaskedColumnError(TabularMaskingError):
    """A column matches no policy rule and the policy has no default action (fail closed)."""


class PIIDetectedError(TabularMaskingError):
    """A column that would be passed through unmasked contains PII-shaped values."""


class MalformedTableError(TabularMaskingError):
    """The input file is not a readable CSV/Parquet table, or a column has the wrong type for its rule."""


class UnsupportedFormatError(TabularMaskingError):
    """The file suffix is not one we read or write (.csv, .parquet, .pq), or a .csv file is not
    comma-separated (semicolon, tab or pipe)."""


class CsvFormulaError(TabularMaskingError):
    """A text cell of the CSV output would be read as a formula by a spreadsheet (it starts with
    ``=``, ``+``, ``-``, ``@``, a tab or a CR and is not a number) and the policy's
    ``csv_formula_guard`` is ``refuse``. The message names the column and row, never the value."""

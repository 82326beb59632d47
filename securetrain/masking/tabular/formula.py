"""The CSV writer's guard against formula (CSV) injection.

A spreadsheet opening a CSV runs a cell that starts with ``=``, ``+``, ``-`` or ``@`` as a formula
(``=HYPERLINK(...)``, ``-2+3+cmd|' /C calc'!A0``), and some also one that starts with a tab or a
CR. Masking keeps free text as it was, so such a cell of the input would reach a finance analyst's
spreadsheet from a file that is "safe to open". OWASP's remedy is a leading ``'``, which the
spreadsheet shows as text and does not run. Numbers (``-5``, ``+3.2``, ``-1e5``) are left alone:
they are data, and a spreadsheet reads them as the numbers they are.

The check looks at each cell's first byte through the string array's offsets (one vectorised
gather, no per-cell Python); only cells starting with ``+`` or ``-`` are matched against the number
pattern.
"""

from __future__ import annotations

import re
from typing import Literal, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securetrain.masking.tabular.errors import CsvFormulaError

FormulaGuard = Literal["escape", "refuse", "off"]
FORMULA_LEADS = "=+-@\t\r"
FORMULA_HINT = ("the policy's csv_formula_guard is 'refuse': set it to 'escape' (a leading ' makes the cell "
                "text in a spreadsheet) or 'off', write Parquet, or clean the column first")
_SIGNED = b"+-"
_LEAD_TABLE = np.zeros(256, np.uint8)  # 1: a formula lead, 2: a sign (a number may start with it)
_LEAD_TABLE[list(FORMULA_LEADS.encode())] = 1
_LEAD_TABLE[list(_SIGNED)] = 2
# ASCII digits only: RE2's \d and Python's differ (Python's takes other scripts' digits).
_DECIMAL = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_NUMBER = f"^{_DECIMAL}$"  # RE2 (pyarrow): $ is the end of the text
_NUMBER_RE = re.compile(_DECIMAL)  # fullmatch: Python's $ would also match before a final "\n"


def is_formula_text(text: str) -> bool:
    """Whether a spreadsheet would read ``text`` as a formula (and it is not a number)."""
    return bool(text) and text[0] in FORMULA_LEADS and not (text[0] in "+-" and _NUMBER_RE.fullmatch(text))


def formula_rows(arr: pa.Array) -> np.ndarray:
    """Rows (0-based, ascending) of the string array's cells :func:`is_formula_text` flags."""
    data = arr.buffers()[2]
    if data is None or not len(arr) or arr.null_count == len(arr):
        return np.zeros(0, np.int64)
    text = np.frombuffer(data, np.uint8)
    if not len(text):
        return np.zeros(0, np.int64)
    offsets = np.frombuffer(arr.buffers()[1], np.int32, count=len(arr) + 1, offset=4 * arr.offset)
    starts, ends = offsets[:-1], offsets[1:]
    # Each cell's first byte (an empty cell's is its neighbour's: dropped below, among the few hits).
    lead = _LEAD_TABLE[text[np.minimum(starts, len(text) - 1)]]
    rows = np.flatnonzero(lead)
    rows = rows[ends[rows] > starts[rows]]
    if arr.null_count and len(rows):
        rows = rows[arr.is_valid().to_numpy(zero_copy_only=False)[rows]]
    signed = rows[lead[rows] == 2]
    if len(signed):  # "-5" is a number, "-2+3+cmd|..." is not
        number = pc.match_substring_regex(arr.take(pa.array(signed)), _NUMBER).to_numpy(zero_copy_only=False)
        rows = np.setdiff1d(rows, signed[number], assume_unique=True)
    return rows.astype(np.int64, copy=False)


def escape_rows(arr: pa.Array, rows: np.ndarray) -> pa.Array:
    """The string array with ``'`` put before the cells at ``rows``."""
    mask = np.zeros(len(arr), bool)
    mask[rows] = True
    return pc.if_else(pa.array(mask), pc.binary_join_element_wise("'", arr, ""), arr)


def raise_formula_cells(column: str, rows: np.ndarray) -> NoReturn:
    """Refuse the cells at ``rows`` of ``column``: by column and row number, never by value (it may
    be PHI)."""
    raise CsvFormulaError(
        f"cannot write CSV: column {column!r} has {len(rows)} cell(s) a spreadsheet would run as a formula "
        f"(starting with =, +, -, @, a tab or a CR; not a number), the first in row {int(rows[0]) + 1} "
        "(1 = the first row after the header)",
        hint=FORMULA_HINT)

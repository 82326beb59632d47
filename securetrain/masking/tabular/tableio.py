"""Reading and writing CSV/Parquet tables, by file suffix, with sanitised errors.

pyarrow's parse errors quote the offending row ("Expected 5 columns, got 3: John,Smith,...").
That text would put PII into logs and terminals, so errors are rebuilt from safe parts only.
Files are read into memory once: the sha256 we audit is of exactly the bytes we parsed.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.tabular.csvtext import VERBATIM_NULLS, csv_text_field
from securetrain.masking.tabular.errors import CsvFormulaError, MalformedTableError, UnsupportedFormatError
from securetrain.masking.tabular.formula import (
    FORMULA_HINT,
    FormulaGuard,
    escape_rows,
    formula_rows,
    is_formula_text,
    raise_formula_cells,
)

Format = Literal["csv", "parquet"]
LineEnd = Literal["\n", "\r\n"]
_SUFFIXES: dict[str, Format] = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


def detect_format(path: str | os.PathLike[str]) -> Format:
    suffix = Path(path).suffix.lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        raise UnsupportedFormatError(
            f"unsupported table format {suffix or '(no suffix)'!r} for {Path(path).name}",
            hint="use a .csv, .parquet or .pq file",
        ) from None


def _safe_csv_reason(exc: Exception) -> str:
    text = str(exc)
    for pattern in (r"Expected \d+ columns, got \d+", r"Empty CSV file", r"row #?\d+", r"Invalid UTF8"):
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m:
            return m.group(0)
    return type(exc).__name__


_NOT_UTF8_HINT = "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 in.csv > out.csv)"


def csv_header(data: bytes) -> list[str]:
    """Column names from the first CSV record (handles BOM and quoting), however long it is: only
    that record is decoded, line by line, not the whole file."""
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8-sig", errors="replace", newline="")
    try:
        return next(csv.reader(text), [])
    except csv.Error:
        return []


_OTHER_DELIMITERS = {";": "semicolon", "\t": "tab", "|": "pipe"}
_EXCEL_HINT = "export it from Excel as 'CSV UTF-8 (Comma delimited)', or write Parquet"
# Files that are not text, by their first bytes: named .csv by mistake.
_OTHER_KINDS = (
    (b"PAR1", "a Parquet file", "name it .parquet"),
    (b"PK\x03\x04", "a ZIP archive (an Excel .xlsx workbook?)", _EXCEL_HINT),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an OLE2 file (an Excel .xls workbook?)", _EXCEL_HINT),
)
_UTF16_HINT = "; from UTF-16 (Excel's 'Unicode text'): iconv -f utf-16 -t utf-8 in.csv > out.csv"


def read_csv_header(data: bytes, name: str) -> list[str]:
    """The column names of a CSV (:func:`csv_header`), refused before any policy decision where
    the file is not what masking reads: a header that is not UTF-8 (Latin-1, UTF-16: names with
    replacement characters or NULs) and a file separated by something else than commas (one
    column named after the whole header, which a policy with a default could keep, every
    identifier inside)."""
    for magic, kind, hint in _OTHER_KINDS:
        if data.startswith(magic):
            raise UnsupportedFormatError(f"cannot read {name} as CSV: it is {kind}", hint=hint)
    header = csv_header(data)
    garbled = [n for n in header if "\x00" in n or ("\ufffd" in n and n.encode() not in data)]
    if garbled:
        raise MalformedTableError(
            f"cannot read {name} as CSV: its header line is not valid UTF-8 text (it looks like Latin-1 or "
            "UTF-16); the column names cannot be matched to the policy",
            hint=_NOT_UTF8_HINT + _UTF16_HINT)
    if any(ord(ch) < 32 and ch not in "\t\r\n" for n in header for ch in n):
        raise MalformedTableError(
            f"cannot read {name} as CSV: its header holds control characters (it is not a text CSV file)",
            hint="check the file: export the table as CSV UTF-8, or write Parquet")
    for sep, word in _OTHER_DELIMITERS.items():
        # As many of them in the names as there are columns: the file is separated by them (a
        # one-column header, or one cut at the commas inside its names: 'amount, EUR').
        if header and sum(n.count(sep) for n in header) >= len(header):
            raise UnsupportedFormatError(
                f"cannot read {name}: it looks {word}-separated ({sep!r} between its column names); "
                "masking reads comma-separated CSV only",
                hint="export the file comma-separated with '.' as the decimal point, e.g. "
                     f"pandas.read_csv(path, sep={sep!r}, dtype=str, keep_default_na=False)"
                     ".to_csv(out, index=False), or write Parquet")
    return header


def _csv_parse_options(data: bytes) -> pacsv.ParseOptions:
    """Quoted values may hold line breaks (RFC 4180). pyarrow's reader only splits its parse blocks
    correctly around them with ``newlines_in_values`` (else a long file is refused, or rows are cut
    inside a quoted value); that costs about a quarter of the parse, so it is set only for a
    file that has a double quote at all (without one, no value can hold a line break)."""
    return pacsv.ParseOptions(newlines_in_values=b'"' in data)


# pyarrow's CSV reader parses blocks of 1 MiB (default) and refuses a row longer than one.
_MAX_BLOCK = 2**31 - 1


def _read_csv(data: bytes, convert_options: pacsv.ConvertOptions) -> pa.Table:
    """pyarrow's CSV reader on ``data`` (:func:`_csv_parse_options`); a file with a row longer than
    a parse block (a cell of a few MB: a pasted statement in a notes column) is read again with
    blocks as large as the file."""
    parse = _csv_parse_options(data)
    try:
        return pacsv.read_csv(pa.BufferReader(data), parse_options=parse, convert_options=convert_options)
    except pa.ArrowInvalid as exc:
        if "straddl" not in str(exc) or len(data) >= _MAX_BLOCK:
            raise
    return pacsv.read_csv(pa.BufferReader(data), parse_options=parse, convert_options=convert_options,
                          read_options=pacsv.ReadOptions(block_size=len(data) + 1))


def _one_line_terminated(data: bytes) -> bytes:
    """A file that is one line without a line end (a header only) gets one: pyarrow's reader
    calls it empty otherwise. Only such a file is copied."""
    if data.strip(b" \t\xef\xbb\xbf") and b"\n" not in data and b"\r" not in data:
        return data + b"\n"
    return data


def parse_table(data: bytes, fmt: Format, *, name: str, string_columns: Collection[str] | None = None,
                verbatim: bool = False) -> pa.Table:
    """Parse bytes; ``string_columns`` are read as text in CSV so ids keep leading zeros etc., and
    their empty cells are nulls.

    ``verbatim`` (CSV): every other column is read as the text in the file too (``01234``,
    ``1.10``, ``TRUE``, ``NA`` stay as written; an empty unquoted cell is null, a quoted ``""`` is
    ``""``) and marked as CSV text (:mod:`~securetrain.masking.tabular.csvtext`), whose types are
    inferred where they are needed. Without it, pyarrow infers the other columns' types."""
    text = set(string_columns or ())
    nulls: dict[str, Any]
    try:
        if fmt == "csv":
            data = _one_line_terminated(data)
            if verbatim:
                header = read_csv_header(data, name)
                types = {c: pa.string() for c in header}
                nulls = dict(VERBATIM_NULLS)
            else:
                types = {c: pa.string() for c in text}
                nulls = {"strings_can_be_null": False}
            table = _read_csv(data, pacsv.ConvertOptions(column_types=types, **nulls))
        else:
            if not data.startswith(b"PAR1"):
                raise MalformedTableError(
                    f"cannot read {name}: it is not a Parquet file (no PAR1 magic number)",
                    hint="a CSV file must be named .csv; else check that the file is complete")
            return pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        reason = _safe_csv_reason(exc) if fmt == "csv" else type(exc).__name__
        if fmt == "csv" and "utf8" in str(exc).lower():
            not_utf8 = _not_utf8_columns(data)
            if not_utf8:
                _refuse_not_utf8(name, not_utf8)
        raise MalformedTableError(
            f"cannot read {name} as {fmt.upper()}: {reason} (cell contents withheld)",
            hint=_NOT_UTF8_HINT if "utf8" in reason.lower() else
            "check that the file is complete and really is " + fmt.upper(),
        ) from None
    # pyarrow types a CSV column as binary only when its bytes are not UTF-8 (a Latin-1 export):
    # refuse that as what it is, rather than as a column of an odd type.
    binary = [f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
    if binary:
        _refuse_not_utf8(name, binary)
    if verbatim:
        untyped = [f.name for f in table.schema if not pa.types.is_string(f.type)]
        if untyped:  # pyarrow's header and the csv module's differ: nothing may be typed by guess
            raise MalformedTableError(
                f"cannot read {name} as CSV: column(s) {', '.join(untyped)} could not be read as text",
                hint="check the header line of the file (quoting, line breaks in column names)")
        table = pa.Table.from_arrays(
            table.columns,
            schema=pa.schema([f if f.name in text else csv_text_field(f.name, f.type) for f in table.schema]))
    return _empty_cells_as_null(table, text)


def _refuse_not_utf8(name: str, columns: list[str]) -> NoReturn:
    raise MalformedTableError(
        f"cannot read {name} as CSV: column(s) {', '.join(columns)} are not valid UTF-8 text "
        "(cell contents withheld)",
        hint=_NOT_UTF8_HINT,
    )


def _not_utf8_columns(data: bytes) -> list[str]:
    """The columns of a CSV whose bytes are not UTF-8 (only on the error path: read as binary)."""
    try:
        header = csv_header(data)
        table = _read_csv(data, pacsv.ConvertOptions(column_types={c: pa.binary() for c in header}))
    except (pa.ArrowException, OSError, ValueError):
        return []
    bad = []
    for f, col in zip(table.schema, table.columns):
        try:
            pc.cast(col, pa.string())
        except pa.ArrowInvalid:
            bad.append(f.name)
    return bad


def _empty_cells_as_null(table: pa.Table, columns: Collection[str]) -> pa.Table:
    """Empty cells of the ``columns`` forced to text are nulls, as pyarrow makes them in every
    column it types itself: a missing id must stay missing, not become the token of ""."""
    for name in columns:
        if name not in table.column_names:
            continue
        i = table.column_names.index(name)
        col = table.column(i)
        table = table.set_column(i, name, pc.if_else(pc.equal(col, ""), pa.scalar(None, col.type), col))
    return table


def read_bytes(path: str | os.PathLike[str]) -> tuple[bytes, str]:
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise MalformedTableError(f"input table not found: {file}", hint="check the path") from None
    except IsADirectoryError:
        raise MalformedTableError(f"input table is a directory: {file}") from None
    return data, hashlib.sha256(data).hexdigest()


def serialize_table(table: pa.Table, fmt: Format, *, unique_columns: Collection[str] = (),
                    formula_guard: FormulaGuard = "escape", line_end: LineEnd = "\n") -> bytes:
    """``table`` as CSV or Parquet (zstd) bytes. ``unique_columns``: Parquet columns known to hold
    (almost) only distinct values, such as keyed tokens; they are written without dictionary
    encoding, which Parquet would build and then abandon for them (about a quarter of the write
    time of a table with four such columns; the file is no larger). CSV: see :func:`csv_output`
    (``formula_guard``, ``line_end``)."""
    if fmt == "csv":
        return csv_output(table, formula_guard=formula_guard, line_end=line_end).data
    sink = pa.BufferOutputStream()
    plain = set(unique_columns)
    use_dictionary: bool | list[str] = [c for c in table.column_names if c not in plain] if plain else True
    pq.write_table(table, sink, compression="zstd", use_dictionary=use_dictionary)
    return sink.getvalue().to_pybytes()


def csv_line_end(data: bytes) -> LineEnd:
    """The line end of a CSV file's first line: ``"\r\n"`` if it is CRLF, else ``"\n"`` (LF, and
    the rare CR-only file). The writer ends the output's lines the same way."""
    first = data.find(b"\n")
    return "\r\n" if first > 0 and data[first - 1:first] == b"\r" else "\n"


# Rows formatted per step of the CSV writer (bounds the memory of the text and keeps 32-bit offsets).
_CSV_BATCH_ROWS = 1 << 16
_CSV_SPECIAL = (b",", b'"', b"\r", b"\n")
_EMPTY = pa.scalar("", pa.string())


@dataclass(frozen=True)
class CsvOutput:
    """A table as CSV bytes, and how many text cells the formula guard escaped."""

    data: bytes
    escaped_cells: int


def csv_bytes(table: pa.Table, *, formula_guard: FormulaGuard = "escape", line_end: LineEnd = "\n") -> bytes:
    """:func:`csv_output`'s bytes."""
    return csv_output(table, formula_guard=formula_guard, line_end=line_end).data


def csv_output(table: pa.Table, *, formula_guard: FormulaGuard = "escape", line_end: LineEnd = "\n") -> CsvOutput:
    """``table`` as UTF-8 CSV text, each cell written as Python's ``csv.QUOTE_MINIMAL`` writes it:
    quoted only where it holds a comma, a double quote (doubled) or a line break, so a kept cell
    is written exactly as it was read (``01234``, not ``"01234"``). A missing value (null) is an
    empty unquoted cell and the empty string is ``""``, so the two stay apart as in the input;
    in a one-column table a missing value is written ``""`` too (as Python's csv module does), as
    an empty line is skipped by CSV readers and the row would be lost. The header is quoted the
    same way; lines end with ``line_end``. Numbers, booleans, dates and times are written as pyarrow
    formats them (its CSV writer's text). Nested columns are refused by name
    (:class:`MalformedTableError`), as are binary columns that are not UTF-8 text.

    ``formula_guard`` (:mod:`~securetrain.masking.tabular.formula`): a text cell (or column name)
    a spreadsheet would run as a formula is prefixed with ``'`` (``escape``), refused by column and
    row (``refuse``: :class:`CsvFormulaError`), or written as it is (``off``).

    Each text column is scanned once (a memchr over its bytes per special character, and a look
    at each cell's first byte for the guard); where no cell needs quotes (the common case)
    pyarrow's writer writes the rows unquoted, otherwise the cells are quoted here, column by
    column, and joined into lines with pyarrow's kernels."""
    table = _csv_writable(table)
    if table.num_columns == 0:
        return CsvOutput(b"", 0)
    names, escaped = _guarded_names(table.column_names, formula_guard)
    head = io.StringIO()
    csv.writer(head, quoting=csv.QUOTE_MINIMAL, lineterminator=line_end).writerow(names)
    one_column = table.num_columns == 1
    scans = [_scan_column(table.schema.field(i), table.column(i), formula_guard) for i in range(table.num_columns)]
    for i, scan in enumerate(scans):
        if scan is None or not len(scan.formula_rows):
            continue
        if formula_guard == "refuse":
            raise_formula_cells(table.column_names[i], scan.formula_rows)
        table = table.set_column(i, table.schema.field(i).name, escape_rows(_whole_text(table, i), scan.formula_rows))
        escaped += len(scan.formula_rows)
    # The special characters each column's cells are quoted for (None: no cell needs quotes).
    quote_for: list[frozenset[str] | None] = [
        scan.specials if scan is not None and (scan.specials or scan.has_empty) else None for scan in scans]
    if one_column and table.column(0).null_count:  # a missing value is a whole line: written ""
        quote_for = [scans[0].specials if scans[0] is not None else frozenset()]
    sink = pa.BufferOutputStream()
    sink.write(head.getvalue().encode("utf-8"))
    if all(q is None for q in quote_for):
        try:
            pacsv.write_csv(table, sink, write_options=pacsv.WriteOptions(
                include_header=False, quoting_style="none", eol=line_end))
            return CsvOutput(sink.getvalue().to_pybytes(), escaped)
        except pa.ArrowInvalid:  # pragma: no cover - checked above; its message quotes a cell: dropped
            sink = pa.BufferOutputStream()
            sink.write(head.getvalue().encode("utf-8"))
            quote_for = [frozenset(_SPECIAL_TEXT)] * table.num_columns
    for first in range(0, table.num_rows, _CSV_BATCH_ROWS):
        part = table.slice(first, _CSV_BATCH_ROWS)
        cells = [_csv_cells(part.schema.field(i), part.column(i), specials, one_column)
                 for i, specials in enumerate(quote_for)]
        cells[-1] = pc.binary_join_element_wise(cells[-1], _EMPTY, line_end)  # the line's end
        lines = cells[0] if one_column else pc.binary_join_element_wise(*cells, ",")
        start, end = _text_bounds(lines)
        sink.write(lines.buffers()[2][start:end])
    return CsvOutput(sink.getvalue().to_pybytes(), escaped)


def _guarded_names(names: list[str], guard: FormulaGuard) -> tuple[list[str], int]:
    """The header's cells under the formula guard (a column name is a cell the spreadsheet reads too)."""
    if guard == "off":
        return names, 0
    flagged = [i for i, n in enumerate(names) if is_formula_text(n)]
    if flagged and guard == "refuse":
        raise CsvFormulaError(
            f"cannot write CSV: the header cell of column {flagged[0] + 1} (of {len(flagged)} such column name(s)) "
            "would be read as a formula by a spreadsheet (it starts with =, +, -, @, a tab or a CR)",
            hint=FORMULA_HINT)
    return [("'" + n if i in flagged else n) for i, n in enumerate(names)], len(flagged)


def _text_bounds(arr: pa.Array) -> tuple[int, int]:
    """Where a string array's values lie in its data buffer (they are contiguous)."""
    offsets = np.frombuffer(arr.buffers()[1], np.int32, count=len(arr) + 1, offset=4 * arr.offset)
    return int(offsets[0]), int(offsets[-1])


_SPECIAL_TEXT = tuple(ch.decode() for ch in _CSV_SPECIAL)
_NO_ROWS = np.zeros(0, np.int64)


@dataclass(frozen=True)
class _TextScan:
    """What the CSV writer needs to know of a text column, from one pass over it."""

    specials: frozenset[str]  # which of a comma, a quote and the line breaks occur
    has_empty: bool  # an empty string (written "")
    formula_rows: np.ndarray  # rows (0-based) of the cells the formula guard applies to


def scan_text(arr: pa.Array, guard: FormulaGuard) -> _TextScan:
    """One string array's :class:`_TextScan`: one memchr pass over its bytes per special character
    (a column without them costs no per-value test), its shortest value, and each value's first
    byte for the formula guard."""
    data = arr.buffers()[2]
    specials: frozenset[str] = frozenset()
    if data is not None and len(arr):
        start, end = _text_bounds(arr)
        text = bytes(memoryview(data)[start:end])
        specials = frozenset(ch.decode() for ch in _CSV_SPECIAL if ch in text)
    has_empty = arr.null_count < len(arr) and pc.min(pc.binary_length(arr)).as_py() == 0
    rows = _NO_ROWS if guard == "off" else formula_rows(arr)
    return _TextScan(specials, has_empty, rows)


def _scan_column(field: pa.Field, column: pa.ChunkedArray, guard: FormulaGuard) -> _TextScan | None:
    """:func:`scan_text` of a text-like column, its chunks' results combined (rows numbered over
    the column); None for the other types, whose text (pyarrow's formatting of a number, date,
    time...) never needs quotes and is never a formula."""
    if not _is_text_type(column.type):
        return None
    specials: frozenset[str] = frozenset()
    has_empty = False
    rows: list[np.ndarray] = []
    first_row = 0
    for chunk in column.chunks:
        text = _as_text(field, chunk)
        if text is not None and len(text):
            scan = scan_text(text, guard)
            specials, has_empty = specials | scan.specials, has_empty or scan.has_empty
            if len(scan.formula_rows):
                rows.append(scan.formula_rows + first_row)
        first_row += len(chunk)
    return _TextScan(specials, has_empty, np.concatenate(rows) if rows else _NO_ROWS)


def _is_text_type(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    return (pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_binary(type_)
            or pa.types.is_large_binary(type_))


def _whole_text(table: pa.Table, i: int) -> pa.Array:
    column = table.column(i)
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    text = _as_text(table.schema.field(i), arr)
    assert text is not None  # only text columns have formula rows
    return text


def _as_text(field: pa.Field, arr: pa.Array) -> pa.Array | None:
    """A text-like array (string, binary, a dictionary of them) as a string array; None for the
    other types, whose text (pyarrow's formatting of a number, date, time...) never needs quotes.
    Binary that is not UTF-8 is refused by name."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type):
        try:
            return pc.cast(arr, pa.string())
        except pa.ArrowInvalid:
            raise MalformedTableError(
                f"cannot write column {field.name!r} as CSV: it holds bytes that are not UTF-8 text",
                hint="write the output as .parquet, or drop or convert that column") from None
        except pa.ArrowCapacityError:
            raise MalformedTableError(
                f"cannot write column {field.name!r} as CSV: its text is too large",
                hint="write the output as .parquet") from None
    return arr if pa.types.is_string(arr.type) else None


def _csv_cells(field: pa.Field, column: pa.ChunkedArray, specials: frozenset[str] | None,
               one_column: bool) -> pa.Array:
    """One column's cells as CSV text (no nulls). ``specials``: the special characters the
    column's scan found (None: no cell needs quotes); cells holding one of them (a comma, a
    quote or a line break), and empty ones, are quoted (a missing one stays an empty cell, except
    in a one-column table, where it is written ``""``)."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    text = _as_text(field, arr)
    arr = pc.cast(arr, pa.string()) if text is None else text  # pyarrow's CSV writer formats values so
    if one_column and arr.null_count:
        arr = pc.fill_null(arr, "")  # an empty line would be skipped: written ""
    if specials is not None and len(arr):
        mask = pc.equal(pc.binary_length(arr), 0)  # "" is quoted (a missing value is the empty cell)
        for ch in specials:
            mask = pc.or_(mask, pc.match_substring(arr, ch))
        if pc.any(mask).as_py():
            escaped = pc.replace_substring(arr, '"', '""') if '"' in specials else arr
            arr = pc.if_else(mask, pc.binary_join_element_wise('"', escaped, '"', ""), arr)
    return pc.fill_null(arr, "") if arr.null_count else arr


def _csv_writable(table: pa.Table) -> pa.Table:
    """``table`` with view types and fixed-size binary cast to plain string/binary (text, quoted
    where needed, refused if not UTF-8); columns CSV cannot hold are refused by name and type:
    nested ones (lists, structs, maps), extension types (a UUID's bytes are not its text) and types
    pyarrow cannot format as text (intervals)."""
    refused = [f"{f.name} ({f.type})" for f in table.schema if not _csv_holds(f.type)]
    if refused:
        raise MalformedTableError(
            f"cannot write column(s) as CSV: {', '.join(refused)}",
            hint="write the output as .parquet, or drop those columns",
        )
    for i, f in enumerate(table.schema):
        if pa.types.is_string_view(f.type):
            table = table.set_column(i, f.name, pc.cast(table.column(i), pa.string()))
        elif pa.types.is_binary_view(f.type) or pa.types.is_fixed_size_binary(f.type):
            table = table.set_column(i, f.name, pc.cast(table.column(i), pa.binary()))
    return table


def _csv_holds(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    if pa.types.is_nested(type_) or isinstance(type_, pa.BaseExtensionType):
        return False
    try:
        pc.cast(pa.array([], type_), pa.string())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return False
    return True


def write_table(table: pa.Table, path: str | os.PathLike[str], *,
                formula_guard: FormulaGuard = "escape") -> tuple[str, int]:
    """Atomically write ``table`` (format by suffix; CSV under ``formula_guard``); return (sha256,
    size) of the written bytes."""
    data = serialize_table(table, detect_format(path), formula_guard=formula_guard)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest(), len(data)

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
from pathlib import Path
from typing import Any, Literal, NoReturn

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.tabular.csvtext import VERBATIM_NULLS, csv_text_field
from securetrain.masking.tabular.errors import MalformedTableError, UnsupportedFormatError

Format = Literal["csv", "parquet"]
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
            if verbatim:
                header = csv_header(data)
                types = {c: pa.string() for c in header}
                nulls = dict(VERBATIM_NULLS)
            else:
                types = {c: pa.string() for c in text}
                nulls = {"strings_can_be_null": False}
            table = pacsv.read_csv(
                pa.BufferReader(data), convert_options=pacsv.ConvertOptions(column_types=types, **nulls))
        else:
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
        table = pacsv.read_csv(pa.BufferReader(data), convert_options=pacsv.ConvertOptions(
            column_types={c: pa.binary() for c in header}))
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


def serialize_table(table: pa.Table, fmt: Format, *, unique_columns: Collection[str] = ()) -> bytes:
    """``table`` as CSV or Parquet (zstd) bytes. ``unique_columns``: Parquet columns known to hold
    (almost) only distinct values, such as keyed tokens; they are written without dictionary
    encoding, which Parquet would build and then abandon for them (about a quarter of the write
    time of a table with four such columns; the file is no larger)."""
    sink = pa.BufferOutputStream()
    if fmt == "csv":
        pacsv.write_csv(_csv_writable(table), sink)
    else:
        plain = set(unique_columns)
        use_dictionary: bool | list[str] = [c for c in table.column_names if c not in plain] if plain else True
        pq.write_table(table, sink, compression="zstd", use_dictionary=use_dictionary)
    return sink.getvalue().to_pybytes()


def _csv_writable(table: pa.Table) -> pa.Table:
    """``table`` with view types cast to the plain ones pyarrow's CSV writer takes; nested columns
    (lists, structs, maps), which CSV cannot hold, are refused by name and type."""
    nested = [f"{f.name} ({f.type})" for f in table.schema if pa.types.is_nested(f.type)]
    if nested:
        raise MalformedTableError(
            f"cannot write column(s) as CSV: {', '.join(nested)}",
            hint="write the output as .parquet, or drop those columns",
        )
    for i, f in enumerate(table.schema):
        if pa.types.is_string_view(f.type) or pa.types.is_binary_view(f.type):
            plain = pa.string() if pa.types.is_string_view(f.type) else pa.binary()
            table = table.set_column(i, f.name, pc.cast(table.column(i), plain))
    return table


def write_table(table: pa.Table, path: str | os.PathLike[str]) -> tuple[str, int]:
    """Atomically write ``table`` (format by suffix); return (sha256, size) of the written bytes."""
    data = serialize_table(table, detect_format(path))
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest(), len(data)

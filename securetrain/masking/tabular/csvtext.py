"""CSV columns kept as the text in the file, and the types pyarrow's CSV reader would give them.

A CSV holds text. Masking reads a CSV's columns exactly as written (``01234``, ``1.10``, ``1e3``,
``TRUE``, ``NA``, `` 7 ``, a 20-digit account number: pyarrow's type inference would turn them
into ``1234``, ``1.1``, ``1000.0``, ``true``, a missing value, ``7`` and a rounded float), so a
kept column is written back unchanged and a pseudonym is computed from the exact text. An empty
unquoted cell is missing (null); a quoted ``""`` is the empty string. The CSV writer puts them back
as they came (null as an empty cell, ``""`` quoted).

Where a *type* is needed, it is inferred from that text as pyarrow's CSV reader infers it with the
options masking used to read with (the defaults, strings not nullable): generalising a column
(bins need numbers, dates need dates), choosing how a kept column is scanned (a column of numbers
only for whole-value card numbers, as an integer column is), and turning the masked table into
tensors (:class:`~securetrain.masking.tabular.dataset.TabularDataset`, the pipeline's encoder). So
the values, the scan and the features are those of the typed read, and only the written text
changes. Kept columns read this way carry :data:`CSV_TEXT_KEY` in their field metadata (it
survives Parquet), which tells the tensor side which string columns are untyped CSV text; a
string column from Parquet is a string, and stays one.

The inference is exact by construction: the text is written as CSV by pyarrow and read back with
its default inference (one pass for all the columns asked for, on pyarrow's threads). Two shortcuts
come first (a property test compares the result with pyarrow's reader on generated files): a
sample of each column is inferred, and if it holds text that no other type accepts, so does the
column; if the sample is int64, date32 or float64 and the whole column, holding none of the null
spellings, casts to that type as it is, that is what the reader makes of it (it parses those with
the same functions, in the order int64, bool, date32, ..., float64: the sample's type is the first
that its values all parse as, and a cast that takes every value says the column is no wider).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

#: Field metadata key of a column that holds CSV text as written (value ``b"1"``).
CSV_TEXT_KEY = b"securetrain.csv_text"
CSV_TEXT_METADATA = {CSV_TEXT_KEY: b"1"}
# The conversion masking's typed read used (and the reader's defaults otherwise): a column pyarrow
# types as text keeps "" (and "NA"...) as text rather than null.
_TYPED_READ = pacsv.ConvertOptions(strings_can_be_null=False)
# Reading a CSV's columns as written: an empty unquoted cell is missing, a quoted "" is "".
VERBATIM_NULLS: Mapping[str, object] = MappingProxyType(
    {"strings_can_be_null": True, "null_values": [""], "quoted_strings_can_be_null": False})
SAMPLE_ROWS = 1024
_NULL_SPELLINGS = pa.array(_TYPED_READ.null_values, pa.string())
# Types whose text a cast parses as the reader does (the same parsers), tried in the reader's order.
_CAST_KINDS = (pa.int64(), pa.date32(), pa.float64())


def is_csv_text(field: pa.Field) -> bool:
    return bool(field.metadata) and field.metadata.get(CSV_TEXT_KEY) == b"1"


def csv_text_field(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, metadata=CSV_TEXT_METADATA)


def _contiguous(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if not pa.types.is_string(arr.type):
        arr = pc.cast(arr, pa.string())
    return arr


def _read_back(columns: list[pa.Array]) -> list[pa.ChunkedArray]:
    """``columns`` (text, null = missing) written as CSV by pyarrow and read back with inference."""
    names = [f"c{i}" for i in range(len(columns))]  # the real names may repeat or be odd: not needed here
    rows = len(columns[0])
    if rows == 0:  # a CSV with a header and no rows: pyarrow types every column as null
        return [pa.chunked_array([], pa.null()) for _ in columns]
    sink = pa.BufferOutputStream()
    pacsv.write_csv(pa.Table.from_arrays(columns, names=names), sink,
                    write_options=pacsv.WriteOptions(include_header=False))
    table = pacsv.read_csv(
        pa.BufferReader(sink.getvalue()),
        read_options=pacsv.ReadOptions(column_names=names),
        # Newlines only occur quoted (the writer quotes text); a one-column row that is missing
        # is an empty line, which must count.
        parse_options=pacsv.ParseOptions(newlines_in_values=True, ignore_empty_lines=False),
        convert_options=_TYPED_READ,
    )
    if table.num_rows != rows:  # pragma: no cover - the writer and reader disagree: never guess
        raise ValueError(f"CSV type inference read back {table.num_rows} of {rows} rows")
    return [table.column(n) for n in names]


def _as_typed_text(arr: pa.Array) -> pa.ChunkedArray:
    """A column pyarrow types as text: every cell as written, an empty one as "" (not nullable)."""
    return pa.chunked_array([pc.fill_null(arr, "") if arr.null_count else arr])


def _as_number(text: pa.Array, kind: pa.DataType) -> pa.Array | None:
    """``text`` cast to ``kind`` (one of :data:`_CAST_KINDS`, what the reader made of a sample) where
    the cast takes it as it is, else None. A failing cast costs as much as reading the column back
    (it converts everything first), so the null spellings and a sample are checked first."""
    if pc.any(pc.is_in(text, value_set=_NULL_SPELLINGS)).as_py():
        return None  # "NaN" is missing to the reader, NaN to a cast
    try:
        pc.cast(text.slice(0, SAMPLE_ROWS), kind)
        return pc.cast(text, kind)
    except pa.ArrowInvalid:  # padded with spaces, or a value further down is not of that kind
        return None


def infer_types(columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> dict[str, pa.ChunkedArray]:
    """For each text column (a null is an empty unquoted cell), the column pyarrow's CSV reader
    produces from that text with its type inference (int64, float64, bool, date32, time32,
    timestamp, null; else string, where missing cells are "")."""
    texts = {name: _contiguous(arr) for name, arr in columns.items()}
    out: dict[str, pa.ChunkedArray] = {}
    long = [n for n, a in texts.items() if len(a) > SAMPLE_ROWS]
    if long:
        for name, sample in zip(long, _read_back([texts[n].slice(0, SAMPLE_ROWS) for n in long])):
            if pa.types.is_string(sample.type):  # text no other type accepts: the column is text
                out[name] = _as_typed_text(texts[name])
            elif sample.type in _CAST_KINDS:
                number = _as_number(texts[name], sample.type)
                if number is not None:
                    out[name] = pa.chunked_array([number])
    rest = [n for n in texts if n not in out]
    if rest:
        for name, typed in zip(rest, _read_back([texts[n] for n in rest])):
            out[name] = _as_typed_text(texts[name]) if pa.types.is_string(typed.type) else typed
    return {name: out[name] for name in texts}


def infer_table(table: pa.Table, columns: Iterable[str] | None = None) -> pa.Table:
    """``table`` with its CSV-text columns (field metadata :data:`CSV_TEXT_KEY`; of those, only
    ``columns`` if given) replaced by the typed columns pyarrow's CSV reader infers from them (their
    marker dropped); other columns unchanged. For the step that turns a masked table into
    numbers: numeric feature columns of a CSV are numbers again there."""
    wanted = None if columns is None else set(columns)
    marked = [i for i, f in enumerate(table.schema) if is_csv_text(f) and (wanted is None or f.name in wanted)]
    if not marked:
        return table
    typed = infer_types({str(i): table.column(i) for i in marked})
    for i in marked:
        table = table.set_column(i, table.schema.field(i).name, typed[str(i)])
    return table

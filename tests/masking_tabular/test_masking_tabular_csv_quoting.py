"""Masked CSV output is written as a demanding user expects: every kept cell as it was in the
input, quoted only where CSV needs it (Python's csv.QUOTE_MINIMAL: a delimiter, a quote or a line
break in the value), headers too; a quoted "" stays the empty string and a missing cell stays an
empty unquoted cell. Found by review: pyarrow's writer quoted every text cell ("01234" where the
input had 01234), and wrote a missing cell of a one-column table as an empty line, which CSV
readers skip (the row was lost)."""

from __future__ import annotations

import csv
import dataclasses
import io
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from securetrain.masking.tabular.formula import is_formula_text
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.tableio import serialize_table

KEY = bytes(range(32))


def _policy(drop: tuple[str, ...] = ("id",)) -> object:
    return load_policy(data={
        "policy_version": "1",
        "columns": [{"name": n, "action": "drop"} for n in drop],
        "default": {"action": "keep"},
        "detectors": {"enabled": False},
        # These tests pin the cells as written; the formula guard (which changes a cell starting
        # with a CR, as one here does) has its own tests (test_masking_tabular_csv_formula_guard.py).
        "csv_formula_guard": "off",
    })


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_kept_cells_are_written_as_in_the_input_with_minimal_quoting(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_text('id,zip,"amount, EUR",note,"say ""x"""\n'
                   '1,01234,"1,50","line one\nline two",plain\n'
                   '2,007,2.00,"a ""quoted"" word",""\n'
                   '3,,-0.0, spaced ,"\r\n"\n', encoding="utf-8", newline="")
    TabularMasker(_policy(), KEY).mask_file(src, dst)
    expected = [row[1:] for row in _rows(src)]
    assert _rows(dst) == expected
    text = dst.read_bytes().decode("utf-8")
    assert text.splitlines()[0] == 'zip,"amount, EUR",note,"say ""x"""'
    assert text.splitlines()[1] == '01234,"1,50","line one'  # 01234 as written, unquoted
    # minimal quoting, exactly as Python's csv module writes these rows (null -> empty cell)
    buf = io.StringIO()
    csv.writer(buf, quoting=csv.QUOTE_MINIMAL, lineterminator="\n").writerows(expected)
    mine = text.replace('""\n', "\n")  # the quoted empty string: "" in the input, "" in the output
    assert mine == buf.getvalue().replace('""\n', "\n")


def test_missing_and_empty_are_kept_apart(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_text('id,a,b\n1,,""\n2,"",\n', encoding="utf-8")
    TabularMasker(_policy(), KEY).mask_file(src, dst)
    assert dst.read_text(encoding="utf-8") == 'a,b\n,""\n"",\n'


def test_one_column_with_missing_cells_keeps_every_row(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_text("id,label\n1,1\n2,\n3,0\n", encoding="utf-8")
    TabularMasker(_policy(), KEY).mask_file(src, dst)
    assert _rows(dst) == [["label"], ["1"], [""], ["0"]]
    assert pacsv.read_csv(dst).num_rows == 3  # pyarrow's reader skips empty lines: none written


def _random_text(rng: random.Random) -> str | None:
    if rng.random() < 0.1:
        return None
    alphabet = 'ab ,"\n\r;\t0123é中\'=-+@.'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("guard", ["off", "escape"])
@pytest.mark.parametrize("seed", range(4))
def test_random_text_round_trips_through_the_csv_module(tmp_path: Path, seed: int, guard: str) -> None:
    rng = random.Random(seed)
    rows = rng.choice([1, 5, 300, 25_000])
    suffixes = ["", ",", " x", '"']
    cols = {f"c{i}" + rng.choice(suffixes): [_random_text(rng) for _ in range(rows)]
            for i in range(rng.randint(1, 4))}
    table = pa.table({k: pa.array(v, pa.string()) for k, v in cols.items()})
    data = serialize_table(table, "csv", formula_guard=guard)  # type: ignore[arg-type]
    if guard == "escape":  # what the guard writes: a ' before each cell a spreadsheet would run
        cols = {k: [("'" + v if v is not None and is_formula_text(v) else v) for v in values]
                for k, values in cols.items()}
    parsed = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
    assert parsed[0] == list(cols)
    assert parsed[1:] == [["" if v is None else v for v in row] for row in zip(*cols.values())]
    # pyarrow reads it back too, with nulls and "" apart (a one-column null is written "")
    back = pacsv.read_csv(pa.BufferReader(data), parse_options=pacsv.ParseOptions(newlines_in_values=True),
                          convert_options=pacsv.ConvertOptions(
                              column_types={c: pa.string() for c in cols}, strings_can_be_null=True,
                              null_values=[""], quoted_strings_can_be_null=False))
    for name, values in cols.items():
        want = values if len(cols) > 1 else ["" if v is None else v for v in values]
        assert back.column(name).to_pylist() == want


def test_typed_columns_are_written_as_pyarrow_formats_them() -> None:
    import datetime

    table = pa.table({"i": [1, None], "f": [1.5, 1e20], "b": [True, None],
                      "d": pa.array([datetime.date(2020, 1, 2), None]),
                      "s": pa.array(["x", "y"]).dictionary_encode(),
                      "v": pa.array(["a,b", None], pa.string_view())})
    assert serialize_table(table, "csv") == b'i,f,b,d,s,v\n1,1.5,true,2020-01-02,x,"a,b"\n,1e+20,,,y,\n'


def test_empty_tables() -> None:
    assert serialize_table(pa.table({"a": pa.array([], pa.string())}), "csv") == b"a\n"
    assert serialize_table(pa.table({}), "csv") == b""


def test_unquoted_fast_path_writes_what_the_quoting_path_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table with no cell that needs quotes is written by pyarrow's writer unquoted; the same
    text as the quoting path gives."""
    from securetrain.masking.tabular import tableio

    rng = random.Random(7)
    rows = 70_000  # more than one batch of the quoting path
    table = pa.table({
        "id": pa.array([f"{rng.randint(0, 10**6):07d}" if rng.random() > 0.1 else None for _ in range(rows)]),
        "n": pa.array([rng.randint(-5, 5) if rng.random() > 0.1 else None for _ in range(rows)]),
        "x": pa.array([rng.random() * 1e6 for _ in range(rows)]),
        "cat": pa.array([rng.choice(["a b", "é", " 7 ", "TRUE", None]) for _ in range(rows)]).dictionary_encode(),
    })
    fast = serialize_table(table, "csv")
    real = tableio.scan_text  # the scan says a comma occurs: every text column takes the quoting path
    monkeypatch.setattr(tableio, "scan_text",
                        lambda arr, guard: dataclasses.replace(real(arr, guard), specials=frozenset(",")))
    assert serialize_table(table, "csv") == fast
    assert b'"' not in fast


def test_binary_that_is_not_utf8_is_refused_by_name() -> None:
    from securetrain.masking.tabular.errors import MalformedTableError

    with pytest.raises(MalformedTableError, match="'raw'") as info:
        serialize_table(pa.table({"raw": pa.array([b"\xff\xfe"], pa.binary())}), "csv")
    assert "\\xff" not in str(info.value)


def test_fixed_size_binary_is_text_or_refused() -> None:
    """Found by a probe: fixed_size_binary went out raw and unquoted (a comma or line break in the
    bytes split the row); it is text like binary now: quoted where needed, refused if not UTF-8."""
    from securetrain.masking.tabular.errors import MalformedTableError

    table = pa.table({"a": pa.array([b"x,y", b"abc", None], pa.binary(3)), "b": [1, 2, 3]})
    assert serialize_table(table, "csv") == b'a,b\n"x,y",1\nabc,2\n,3\n'
    with pytest.raises(MalformedTableError, match="'a'"):
        serialize_table(pa.table({"a": pa.array([b"\xff\xfe\xfd"], pa.binary(3))}), "csv")


def test_types_csv_cannot_hold_are_refused_by_name() -> None:
    from securetrain.masking.tabular.errors import MalformedTableError

    for arr in (pa.array([None], pa.month_day_nano_interval()), pa.array([bytes(16)], pa.uuid())):
        with pytest.raises(MalformedTableError, match="odd \\(") as info:
            serialize_table(pa.table({"ok": [1], "odd": arr}), "csv")
        assert "parquet" in (info.value.hint or "")

"""CSV files as finance teams send them (not made by the repo's generators): each case either
masks correctly or is refused with a typed error that says what is wrong, before any policy
decision could keep a garbled column.

Found by a probe: a semicolon/tab-separated file was read as ONE column named after the whole
header (under a policy with a default 'keep' it would have been kept, every identifier inside);
a valid CSV with quoted line breaks over more than one parse block was refused (ArrowInvalid: the
reader split blocks inside quoted values); a header-only file without a final newline was "Empty";
a Latin-1 or UTF-16 header gave column names with replacement characters in a fail-closed
message; a column name with a leading space was shown without it."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from securetrain.masking.tabular.errors import (
    MalformedTableError,
    UnmaskedColumnError,
    UnsupportedFormatError,
)
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy

KEY = bytes(range(32))
HEADER = ["customer_id", "full_name", "note", "amount", "category"]


def _masker(default_keep: bool = False) -> TabularMasker:
    data: dict = {"policy_version": "1", "columns": [
        {"name": "customer_id", "action": "tokenize"}, {"name": "full_name", "action": "tokenize"},
        {"name": "note", "action": "drop"}, {"name": "amount", "action": "keep"},
        {"name": "category", "action": "keep"}],
        "detectors": {"enabled": False}}
    if default_keep:
        data["default"] = {"action": "keep"}
    return TabularMasker(load_policy(data=data), KEY)


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


@pytest.mark.parametrize("sep", [";", "\t", "|"])
@pytest.mark.parametrize("default_keep", [False, True])
def test_other_delimiters_are_refused_as_such(tmp_path: Path, sep: str, default_keep: bool) -> None:
    src = tmp_path / "in.csv"
    src.write_text(sep.join(HEADER) + "\n" + sep.join(["007", "Ann Lee", "x", "1,5", "food"]) + "\n",
                   encoding="utf-8")
    with pytest.raises(UnsupportedFormatError, match="separated") as info:
        _masker(default_keep).mask_file(src, tmp_path / "out.csv")
    assert "Ann" not in str(info.value) and "comma" in (info.value.hint or "")
    assert not (tmp_path / "out.csv").exists()


def test_quoted_line_breaks_in_a_long_file(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    rows = [HEADER] + [[f"{i:07d}", f"Name {i}", f"line a {i}\nline b, \"q\"", f"{i}.5", f"cat\r\n{i % 3}"]
                       for i in range(40_000)]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    src.write_text(buf.getvalue(), encoding="utf-8", newline="")
    report = _masker().mask_file(src, dst)
    assert report.rows == 40_000
    out = _rows(dst.read_bytes().decode("utf-8"))
    assert out[0] == ["customer_id", "full_name", "amount", "category"]
    assert [r[2:] for r in out[1:]] == [r[3:] for r in rows[1:]]


def test_crlf_bom_and_quoted_headers(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_bytes(b'\xef\xbb\xbf"customer_id","full_name","note","amount","category"\r\n'
                    b'007,Ann Lee,,01.50,"food, drink"\r\n008,Bob Ray,x,2,travel\r\n')
    _masker().mask_file(src, dst)
    out = _rows(dst.read_bytes().decode("utf-8"))
    assert out[0] == ["customer_id", "full_name", "amount", "category"]
    assert [r[2:] for r in out[1:]] == [["01.50", "food, drink"], ["2", "travel"]]


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r\n"])
def test_header_only(tmp_path: Path, ending: bytes) -> None:
    src = tmp_path / "in.csv"
    src.write_bytes(",".join(HEADER).encode() + ending)
    report = _masker().mask_file(src, tmp_path / "out.csv")
    assert report.rows == 0
    assert (tmp_path / "out.csv").read_text() == "customer_id,full_name,amount,category\n"
    _masker().mask_file(src, tmp_path / "out.parquet")
    assert pq.read_table(tmp_path / "out.parquet").column_names == ["customer_id", "full_name", "amount", "category"]


@pytest.mark.parametrize("data", [b"", b"\xef\xbb\xbf", b"\n\n"])
def test_empty_file(tmp_path: Path, data: bytes) -> None:
    src = tmp_path / "in.csv"
    src.write_bytes(data)
    with pytest.raises(MalformedTableError, match="[Ee]mpty"):
        _masker().mask_file(src, tmp_path / "out.csv")


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16", "utf-16-be"])
def test_header_not_utf8(tmp_path: Path, encoding: str) -> None:
    src = tmp_path / "in.csv"
    src.write_bytes(("customer_id,full_name,note,amount,catégorie\n007,Ann,x,1,a\n").encode(encoding))
    with pytest.raises(MalformedTableError, match="UTF-8") as info:
        _masker(default_keep=True).mask_file(src, tmp_path / "out.csv")
    assert "\ufffd" not in str(info.value)
    assert "iconv" in (info.value.hint or "")


def test_column_names_with_edge_spaces_are_shown_quoted(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text("customer_id, full_name,note,amount,category\n007,Ann,x,1,a\n", encoding="utf-8")
    with pytest.raises(UnmaskedColumnError, match="' full_name'") as info:
        _masker().mask_file(src, tmp_path / "out.csv")
    assert "space" in (info.value.hint or "")


@pytest.mark.parametrize("where", ["dropped", "kept"])
def test_a_row_longer_than_the_readers_block(tmp_path: Path, where: str) -> None:
    """Found by a probe: a cell of a few MB (a pasted statement in a notes column) was refused as
    'ArrowInvalid' (the row straddled pyarrow's 1 MB parse blocks)."""
    big = "x, " * 1_000_000
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    note, category = (big, "food") if where == "dropped" else ("n", big)
    rows = [HEADER, ["007", "Ann Lee", note, "1", category], ["008", "Bob Ray", "y", "2", "travel"]]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    src.write_text(buf.getvalue(), encoding="utf-8")
    assert _masker().mask_file(src, dst).rows == 2
    limit = csv.field_size_limit(10**8)  # Python's csv module reads fields of up to 128 KiB by default
    try:
        out = _rows(dst.read_bytes().decode("utf-8"))
    finally:
        csv.field_size_limit(limit)
    assert [r[2:] for r in out[1:]] == [["1", category], ["2", "travel"]]


@pytest.mark.parametrize(("data", "what"), [
    (b"PAR1\x15\x04\x15\x00,\x15\x12\nL\x15", "Parquet"),
    (b"PK\x03\x04\x14\x00\x06\x00\x08\x00\x00\x00!\x00", "Excel"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1\x00\x00", "Excel"),
])
@pytest.mark.parametrize("default_keep", [False, True])
def test_other_file_kinds_named_csv(tmp_path: Path, data: bytes, what: str, default_keep: bool) -> None:
    """Found by a probe: a Parquet file named .csv was refused as a column named 'PAR1\\x15...'."""
    src = tmp_path / "in.csv"
    src.write_bytes(data + bytes(range(256)) * 4)
    with pytest.raises(UnsupportedFormatError, match=what):
        _masker(default_keep).mask_file(src, tmp_path / "out.csv")


def test_csv_named_parquet(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    src.write_bytes(b"customer_id,amount\n1,2\n")
    with pytest.raises(MalformedTableError, match="not a Parquet file") as info:
        _masker().mask_file(src, tmp_path / "out.csv")
    assert ".csv" in (info.value.hint or "")


def test_control_characters_in_the_header(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_bytes(b"customer_id,amo\x01unt\n1,2\n")
    with pytest.raises(MalformedTableError, match="control character"):
        _masker(default_keep=True).mask_file(src, tmp_path / "out.csv")


@pytest.mark.parametrize("default_keep", [False, True])
def test_semicolon_file_with_commas_in_its_names(tmp_path: Path, default_keep: bool) -> None:
    """A ';'-separated export whose names hold commas ('amount, EUR') splits into a few garbled
    columns at the commas; it is refused as semicolon-separated too. A comma CSV with one name
    holding a ';' among several columns is read."""
    src = tmp_path / "in.csv"
    src.write_text("customer_id;full_name;amount, EUR;category\n007;Ann Lee;1,5;food\n", encoding="utf-8")
    with pytest.raises(UnsupportedFormatError, match="semicolon"):
        _masker(default_keep).mask_file(src, tmp_path / "out.csv")
    src.write_text('customer_id,full_name,note,amount,"category; main"\n007,Ann,x,1,a\n', encoding="utf-8")
    policy = load_policy(data={"policy_version": "1", "columns": [
        {"name": "customer_id", "action": "tokenize"}, {"name": "full_name", "action": "tokenize"},
        {"name": "note", "action": "drop"}], "default": {"action": "keep"}, "detectors": {"enabled": False}})
    TabularMasker(policy, KEY).mask_file(src, tmp_path / "out.csv")
    assert _rows((tmp_path / "out.csv").read_text())[0] == ["customer_id", "full_name", "amount", "category; main"]

"""CSV output guarded against formula (CSV) injection, and written with the input's line ends.

Found by review: a kept text cell starting with ``=``, ``+``, ``-``, ``@``, a tab or a CR was
written as it was, so a finance analyst opening the masked file in a spreadsheet ran it as a
formula (``=HYPERLINK(...)``, ``-2+3+cmd|' /C calc'!A0``). The guard is on by default (the policy's
``csv_formula_guard``): ``escape`` prefixes ``'`` (OWASP) to such text cells, never to numbers;
``refuse`` names the column and row, never the value; ``off`` writes them as they are. And a CRLF
input was written back with LF line ends: the output now ends its lines as the input did.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from securetrain.masking.tabular.errors import CsvFormulaError
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.tableio import csv_bytes, csv_output

KEY = bytes(range(32))
PAYLOADS = ["=1+1", "+cmd", "-2+3+cmd|' /C calc'!A0", "@SUM(A1)", "\tx", "\rx", "=HYPERLINK(\"http://e.test\",\"a,b\")"]
NUMBERS = ["-5", "+3.2", "-1e5", "-.5", "+7.", "-0", "12", "1e3"]


def _policy(guard: str | None = None) -> object:
    data: dict[str, object] = {"policy_version": "1", "default": {"action": "keep"}, "detectors": {"enabled": False}}
    if guard is not None:
        data["csv_formula_guard"] = guard
    return load_policy(data=data)


class _Audit:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def record(self, action: str, resource: str, *, outcome: str = "success", details: dict | None = None) -> None:
        self.events.append({"action": action, "resource": resource, "outcome": outcome, "details": details or {}})


def _write_csv(path: Path, rows: list[list[str]], line_end: str = "\n") -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        # every cell quoted: the csv module leaves a lone CR unquoted with an LF line end
        csv.writer(f, lineterminator=line_end, quoting=csv.QUOTE_ALL).writerows(rows)


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_policy_default_is_escape_and_unknown_modes_are_refused() -> None:
    assert _policy().csv_formula_guard == "escape"
    assert _policy("refuse").csv_formula_guard == "refuse"
    assert _policy().digest != _policy("off").digest  # the digest says which guard was applied
    from securetrain.errors import ConfigError

    with pytest.raises(ConfigError, match="csv_formula_guard"):
        _policy("strip")


def test_escape_prefixes_a_quote_to_formula_text_but_never_to_numbers(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    text = PAYLOADS + NUMBERS + ["plain", "a-b", "'=already"]
    _write_csv(src, [["note"], *([v] for v in text)])
    audit = _Audit()
    report = TabularMasker(_policy(), KEY, audit=audit).mask_file(src, dst)
    out = [row[0] for row in _rows(dst)[1:]]
    assert out == ["'" + v for v in PAYLOADS] + NUMBERS + ["plain", "a-b", "'=already"]
    assert report.csv_formula_guard == "escape" and report.formula_cells_escaped == len(PAYLOADS)
    write = [e for e in audit.events if e["action"] == "tabular.write"][0]["details"]
    assert write["csv_formula_guard"] == "escape" and write["formula_cells_escaped"] == len(PAYLOADS)


def test_numeric_columns_and_parquet_output_are_untouched(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"n": [-5, 3], "x": [-1e5, 2.5], "s": ["=1+1", "ok"]}), src)
    masker = TabularMasker(_policy(), KEY)
    report = masker.mask_file(src, tmp_path / "out.csv")
    assert _rows(tmp_path / "out.csv") == [["n", "x", "s"], ["-5", "-100000", "'=1+1"], ["3", "2.5", "ok"]]
    assert report.formula_cells_escaped == 1
    report = masker.mask_file(src, tmp_path / "out.parquet")
    assert pq.read_table(tmp_path / "out.parquet").column("s").to_pylist() == ["=1+1", "ok"]
    assert report.formula_cells_escaped == 0 and report.csv_formula_guard is None


def test_header_cells_are_guarded_too() -> None:
    table = pa.table({"=cmd": ["a"], "-3": ["b"], "ok": ["c"]})
    assert csv_bytes(table) == b"'=cmd,-3,ok\na,b,c\n"
    with pytest.raises(CsvFormulaError, match="header") as info:
        csv_bytes(table, formula_guard="refuse")
    assert "=cmd" not in str(info.value)


def test_refuse_names_column_and_row_never_the_value(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    _write_csv(src, [["id", "note"], ["1", "fine"], ["2", "-5"], ["3", "=SECRET_PHI()"], ["4", "@x"]])
    audit = _Audit()
    with pytest.raises(CsvFormulaError) as info:
        TabularMasker(_policy("refuse"), KEY, audit=audit).mask_file(src, dst)
    message = str(info.value)
    assert "'note'" in message and "row 3" in message and "2 cell(s)" in message
    assert "SECRET_PHI" not in message and "@x" not in message
    assert "csv_formula_guard" in (info.value.hint or "")
    assert not dst.exists()
    refused = [e for e in audit.events if e["action"] == "tabular.write"]
    assert refused and refused[0]["outcome"] == "refused"
    assert refused[0]["details"]["error"] == "CsvFormulaError"


def test_off_writes_cells_as_they_are(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    _write_csv(src, [["note"], *([v] for v in PAYLOADS)])
    report = TabularMasker(_policy("off"), KEY).mask_file(src, dst)
    assert [row[0] for row in _rows(dst)[1:]] == PAYLOADS
    assert report.csv_formula_guard == "off" and report.formula_cells_escaped == 0


def test_escaped_table_without_special_characters_keeps_the_unquoted_fast_path() -> None:
    table = pa.table({"a": ["=1", "\tx", None, "y"], "b": pa.array(["@u", "v", "w", "-5"]).dictionary_encode(),
                      "n": [1, -2, None, 4]})
    out = csv_output(table)
    assert out.data == b"a,b,n\n'=1,'@u,1\n'\tx,v,-2\n,w,\ny,-5,4\n"
    assert out.escaped_cells == 3


def test_each_text_column_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan that decides quoting (and finds formula cells) runs once per column chunk, not
    again when the cells are quoted (it used to run twice)."""
    from securetrain.masking.tabular import tableio

    calls: list[int] = []
    real = tableio.scan_text
    monkeypatch.setattr(tableio, "scan_text", lambda arr, guard: calls.append(len(arr)) or real(arr, guard))
    table = pa.table({"a": ["x,y", "=z"] * 40_000, "b": ["p", "q"] * 40_000, "n": [1, 2] * 40_000})
    data = csv_bytes(table)
    assert calls == [80_000, 80_000]
    assert data.startswith(b'a,b,n\n"x,y",p,1\n\'=z,q,2\n')


def test_crlf_input_gives_crlf_output(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_bytes(b'id,note,n\r\n1,"two\nlines",5\r\n2,plain,6\r\n')
    report = TabularMasker(_policy(), KEY).mask_file(src, dst)
    assert dst.read_bytes() == b'id,note,n\r\n1,"two\nlines",5\r\n2,plain,6\r\n'  # the quoted LF is a value
    assert report.csv_line_end == "\r\n"
    src.write_bytes(b"id,note\r\n1,plain\r\n")  # the unquoted fast path too
    TabularMasker(_policy(), KEY).mask_file(src, dst)
    assert dst.read_bytes() == b"id,note\r\n1,plain\r\n"


def test_lf_input_and_parquet_input_give_lf_output(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_bytes(b'id,note\n1,"a,b"\n')
    TabularMasker(_policy(), KEY).mask_file(src, dst)
    assert dst.read_bytes() == b'id,note\n1,"a,b"\n'
    pq.write_table(pa.table({"id": ["1"]}), tmp_path / "in.parquet")
    report = TabularMasker(_policy(), KEY).mask_file(tmp_path / "in.parquet", dst)
    assert dst.read_bytes() == b"id\n1\n" and report.csv_line_end is None


def test_csv_reader_reads_escaped_output_back() -> None:
    table = pa.table({"a": PAYLOADS, "b": NUMBERS[: len(PAYLOADS)]})
    parsed = list(csv.reader(io.StringIO(csv_bytes(table, line_end="\r\n").decode(), newline="")))
    assert parsed[1:] == [["'" + p, n] for p, n in zip(PAYLOADS, NUMBERS)]

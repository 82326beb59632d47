"""Masking a CSV keeps the text of its kept columns as written, and computes masked columns from
that exact text; types are inferred only where they are needed (generalising, choosing the scan,
making tensors), as pyarrow's CSV reader infers them.

Found by a probe: pyarrow's type inference rewrote kept columns ("01234" -> 1234, "1.10" -> 1.1,
"1e3" -> 1000, "TRUE" -> true, "NA" -> missing, " 7 " -> 7, 20-digit account numbers -> rounded
floats), and the same-row scrub looked for the id 7 where the file said 007.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
import typer
from typer.testing import CliRunner

from securetrain.masking.tabular.cli import register
from securetrain.masking.tabular.csvtext import CSV_TEXT_KEY, infer_table, infer_types, is_csv_text
from securetrain.masking.tabular.dataset import TabularDataset
from securetrain.masking.tabular.errors import MalformedTableError, PIIDetectedError
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy

KEY = bytes(range(32))
# pyarrow's default null spellings and boolean spellings: text a typed read turns into null/bool.
NULL_WORDS = ["#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "N/A", "NA",
              "NULL", "NaN", "n/a", "nan", "null"]
TRICKY = [
    "0", "00", "007", "01234", "1234", "-0", "+5", "-01", "0001.5", "1.10", "1.1", ".5", "5.", "-0.0", "1e3", "1E3",
    "1e+3", "1e-7", "1e400", "0x1F", "1_000", "12345678901234567890", "99999999999999999999999",
    "9223372036854775807", "9223372036854775808", "-9223372036854775809", "0.1000000000000000055511151231257827",
    "TRUE", "True", "true", "FALSE", "False", "false", "1", "inf", "-inf", "Infinity", "+inf", " 7", "7 ", " 7 ",
    "\t7", "  ", " true", "2023-04-01", "2023-04-01 12:00:00", "2023-04-01T12:00:00Z", "2023-04-01 12:00",
    "2023-4-1", "12:00", "12:00:00", "20230401", "1,5", 'say "hi"', "x", "Zürich", "中文", "-", "+", "'01",
    *NULL_WORDS,
]


def _quote(v: str) -> str:
    return '"' + v.replace('"', '""') + '"'


def write_csv(path: Path, columns: dict[str, list[str | None]], rng: random.Random) -> None:
    """A CSV as a spreadsheet or a hand-written export has it: missing cells empty and unquoted,
    empty strings as "", other cells quoted where they must be and at random elsewhere."""
    names = list(columns)
    lines = [",".join(names)]
    for row in zip(*columns.values()):
        cells = []
        for v in row:
            if v is None:
                cells.append("")
            elif v == "" or any(ch in v for ch in ',"') or rng.random() < 0.3:
                cells.append(_quote(v))
            else:
                cells.append(v)
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _digits(rng: random.Random) -> str:
    s = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25)))
    return ("-" if rng.random() < 0.1 else "") + ("0" * rng.randint(0, 2) if rng.random() < 0.3 else "") + s


def _cell(rng: random.Random, flavour: str, gaps: bool = True) -> str | None:
    r = rng.random() if gaps else 1.0
    if r < 0.08:
        return None
    if r < 0.12:
        return ""
    if r < 0.15:
        return rng.choice(NULL_WORDS)
    if flavour == "ints":
        return _digits(rng)
    if flavour == "counts":  # fit int64
        return rng.choice(["", "-"]) + "0" * rng.randint(0, 2) + str(rng.randint(0, 10 ** rng.randint(1, 12)))
    if flavour == "floats":
        return rng.choice([f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 4)}f}", f"{rng.random():.3e}",
                           _digits(rng) + "." + _digits(rng).lstrip("-"), "1.10", "inf", "-0.0", "1e3"])
    if flavour == "bools":
        return rng.choice(["TRUE", "True", "true", "FALSE", "False", "false"])
    if flavour == "days":
        return f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if flavour == "dates":
        return rng.choice([f"20{rng.randint(0, 29):02d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                           "2023-04-01 12:00:00", "1999-12-31"])
    text = rng.choice(TRICKY) if rng.random() < 0.7 else "".join(rng.choice("ab XY09-.,\"é中\t") for _ in range(6))
    return rng.choice(["", " ", "  "]) + text + rng.choice(["", " "]) if rng.random() < 0.15 else text


FLAVOURS = ("ints", "counts", "floats", "bools", "days", "dates", "mixed")


def _table_spec(rng: random.Random, rows: int) -> dict[str, list[str | None]]:
    """An id column (every tricky spelling) and kept columns of each flavour, some without gaps,
    some nearly pure (one stray text cell, often past the first 1,024 rows, changes the type)."""
    ids = [rng.choice(TRICKY) if rng.random() < 0.6 else _digits(rng) for _ in range(rows)]
    ids = [v for v in ids if v.strip()] or ["1"]
    rows = len(ids)
    spec: dict[str, list[str | None]] = {"id": ids}  # type: ignore[dict-item]
    for i, flavour in enumerate(rng.sample(FLAVOURS, 5)):
        gaps = rng.random() < 0.6
        values = [_cell(rng, flavour, gaps) for _ in range(rows)]
        if flavour != "mixed" and rng.random() < 0.2:
            values[rng.randrange(rows)] = rng.choice(TRICKY)
        spec[f"k{i}_{flavour}"] = values
    return spec


def _policy(**detectors: object) -> object:
    return load_policy(data={
        "policy_version": "1",
        "columns": [{"name": "id", "action": "tokenize", "normalize": "none"}],
        "default": {"action": "keep"},
        # Scanned (types inferred for it), without the detectors random digits could set off.
        "detectors": {"detectors": ["email", "ssn", "iban", "person"], "row_values": "off", **detectors},
        # Kept text is pinned cell for cell here ("+", "-x"); the formula guard has its own tests.
        "csv_formula_guard": "off",
    })


def _read_text(path: Path) -> pa.Table:
    """A CSV read back as text: an empty unquoted cell is null, a quoted "" is ""."""
    return pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
        column_types={c: pa.string() for c in path.read_text().splitlines()[0].replace('"', "").split(",")},
        strings_can_be_null=True, null_values=[""], quoted_strings_can_be_null=False))


def test_kept_csv_columns_are_written_as_they_were(tmp_path: Path) -> None:
    """The probe's cases: CSV -> CSV and CSV -> Parquet write every kept cell as it was."""
    m = TabularMasker(_policy(), KEY)
    (tmp_path / "in.csv").write_text(
        'id,zip,amount,sci,flag,na,pad,account,note\n'
        '01234,01234,1.10,1e3,TRUE,NA, 7 ,12345678901234567890,\n'
        '1234,00001,2.50,1E-2,false,n/a,7,00000000000000000001,""\n'
        '"0x1F",007,-0.0,inf,True,,"  ",98765432109876543210,"a,""b"""\n')
    m.mask_file(tmp_path / "in.csv", tmp_path / "out.csv")
    m.mask_file(tmp_path / "in.csv", tmp_path / "out.parquet")
    original, as_csv = _read_text(tmp_path / "in.csv"), _read_text(tmp_path / "out.csv")
    as_parquet = pq.read_table(tmp_path / "out.parquet")
    for name in original.column_names[1:]:
        assert as_csv.column(name).to_pylist() == original.column(name).to_pylist(), name
        assert as_parquet.column(name).to_pylist() == original.column(name).to_pylist(), name
    assert as_parquet.column("zip").to_pylist() == ["01234", "00001", "007"]
    assert as_parquet.column("account").to_pylist()[0] == "12345678901234567890"
    assert as_parquet.column("note").to_pylist() == [None, "", 'a,"b"']  # missing vs empty
    # On disk: a missing cell is empty, an empty string quoted, as they came; other cells unquoted.
    assert (tmp_path / "out.csv").read_text().splitlines()[1].endswith(',01234,1.10,1e3,TRUE,NA, 7 ,12345678901234567890,')
    assert (tmp_path / "out.csv").read_text().splitlines()[2].endswith(',""')
    # Pseudonyms are of the text as written: 01234 is not 1234, 0x1F is not 31.
    ids = as_parquet.column("id").to_pylist()
    assert ids == m.mask_table(pa.table({"id": ["01234", "1234", "0x1F"]})).column("id").to_pylist()
    assert len(set(ids)) == 3


def test_cli_mask_keeps_csv_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = typer.Typer()
    register(app)
    policy = tmp_path / "p.yaml"
    policy.write_text("policy_version: '1'\ncolumns: [{name: id, action: tokenize}]\ndefault: {action: keep}\n")
    (tmp_path / "in.csv").write_text("id,zip,amount\n1,01234,1.10\n2,00042,1e3\n")
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", KEY.hex())
    result = CliRunner().invoke(app, ["mask", str(tmp_path / "in.csv"), str(tmp_path / "out.csv"), "-p", str(policy)])
    assert result.exit_code == 0, result.output
    out = _read_text(tmp_path / "out.csv")
    assert out.column("zip").to_pylist() == ["01234", "00042"] and out.column("amount").to_pylist() == ["1.10", "1e3"]


@pytest.mark.parametrize("seed", range(12))
def test_generated_tricky_text_round_trips_and_tokens_are_of_the_exact_text(tmp_path: Path, seed: int) -> None:
    """Property test over generated tables: every kept cell comes back exactly (CSV and Parquet
    output), missing stays missing, "" stays "", and each token is the token of the cell's text."""
    rng = random.Random(seed)
    m = TabularMasker(_policy(), KEY)
    for t in range(6):
        spec = _table_spec(rng, rng.choice([1, 3, 40, 120]))
        src = tmp_path / f"in{t}.csv"
        write_csv(src, spec, rng)
        m.mask_file(src, tmp_path / f"out{t}.csv")
        m.mask_file(src, tmp_path / f"out{t}.parquet")
        back_csv, back_parquet = _read_text(tmp_path / f"out{t}.csv"), pq.read_table(tmp_path / f"out{t}.parquet")
        for name, values in spec.items():
            if name == "id":
                continue
            assert back_csv.column(name).to_pylist() == values, (seed, t, name)
            assert back_parquet.column(name).to_pylist() == values, (seed, t, name)
            assert back_parquet.schema.field(name).type == pa.string() and is_csv_text(back_parquet.schema.field(name))
        tokens = back_parquet.column("id").to_pylist()
        assert tokens == back_csv.column("id").to_pylist()
        assert tokens == m.mask_table(pa.table({"id": spec["id"]})).column("id").to_pylist()
        by_text = dict(zip(spec["id"], tokens))
        assert len(set(by_text.values())) == len(by_text)  # distinct text, distinct pseudonym


@pytest.mark.parametrize("seed", range(8))
def test_inferred_types_are_those_of_pyarrows_csv_reader(tmp_path: Path, seed: int) -> None:
    """The types (and values) given to CSV text where a type is needed equal a typed read of the
    same file, also when pyarrow reads it in many blocks."""
    rng = random.Random(100 + seed)
    for t in range(5):
        spec = _table_spec(rng, rng.choice([1, 2, 50, 1500, 3000]))
        src = tmp_path / f"in{t}.csv"
        write_csv(src, spec, rng)
        text = _read_text(src)
        typed = infer_types({c: text.column(c) for c in text.column_names})
        for block_size in (1 << 20, 4096):
            expected = pacsv.read_csv(src, read_options=pacsv.ReadOptions(block_size=block_size),
                                      convert_options=pacsv.ConvertOptions(strings_can_be_null=False))
            for name in spec:
                assert typed[name].type == expected.column(name).type, (seed, t, name, block_size)
                assert typed[name].to_pylist() == expected.column(name).to_pylist(), (seed, t, name)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e400 is inf, either way
@pytest.mark.parametrize("seed", range(6))
def test_dataset_from_csv_has_the_typed_reads_tensors(tmp_path: Path, seed: int) -> None:
    """Training sees numbers where the CSV holds numbers: TabularDataset of a CSV equals the
    TabularDataset of the table pyarrow's typed read makes of it (features and labels)."""
    rng = random.Random(200 + seed)
    m = TabularMasker(_policy(), KEY)
    for t in range(4):
        spec = _table_spec(rng, 60)
        spec["y"] = [rng.choice(["0", "1", "01", "2"]) for _ in spec["id"]] if t % 2 else \
            [rng.choice(["fraud", "ok", "1.5"]) for _ in spec["id"]]
        src = tmp_path / f"in{t}.csv"
        write_csv(src, spec, rng)
        typed = pacsv.read_csv(src, convert_options=pacsv.ConvertOptions(
            column_types={"id": pa.string()}, strings_can_be_null=False))
        from_csv, from_typed = TabularDataset(src, m, target="y"), TabularDataset(typed, m, target="y")
        assert from_csv.feature_names == from_typed.feature_names
        assert torch.equal(from_csv.features, from_typed.features), (seed, t)
        assert torch.equal(from_csv.labels, from_typed.labels) and from_csv.class_names == from_typed.class_names


def test_dataset_numeric_columns_of_a_csv_are_numbers(tmp_path: Path) -> None:
    (tmp_path / "in.csv").write_text("id,hour,amount,code,y\n1,07,1.10,A1,1\n2,23,1e3,B2,0\n3,,NA,C3,1\n")
    ds = TabularDataset(tmp_path / "in.csv", TabularMasker(_policy(), KEY), target="y", n_buckets=4)
    hour, amount = ds.feature_names.index("hour"), ds.feature_names.index("amount")
    assert ds.features[:, hour].tolist() == [7.0, 23.0, 0.0]  # missing -> 0
    assert torch.equal(ds.features[:, amount], torch.tensor([1.1, 1000.0, 0.0]))
    assert "code#0" in ds.feature_names  # text stays text
    assert ds.labels.dtype == torch.int64 and ds.labels.tolist() == [1, 0, 1] and ds.class_names is None


def test_parquet_types_are_kept_as_they_are(tmp_path: Path) -> None:
    """Parquet is typed: nothing is inferred, a string column of digits stays a string column
    (for training too), numbers stay numbers."""
    import datetime as dt
    from decimal import Decimal

    table = pa.table({
        "id": ["1", "2"], "code": ["01234", "00042"], "n": pa.array([1, 2], pa.int32()), "f": [1.1, None],
        "b": [True, False], "d": [dt.date(2023, 4, 1), None], "dec": pa.array([Decimal("1.10"), Decimal("2.00")]),
        "y": [0, 1]})
    pq.write_table(table, tmp_path / "in.parquet")
    m = TabularMasker(_policy(), KEY)
    m.mask_file(tmp_path / "in.parquet", tmp_path / "out.parquet")
    out = pq.read_table(tmp_path / "out.parquet")
    for name in table.column_names[1:]:
        assert out.schema.field(name).type == table.schema.field(name).type, name
        assert out.column(name).to_pylist() == table.column(name).to_pylist(), name
        assert not is_csv_text(out.schema.field(name))
    assert infer_table(out).equals(out)
    ds = TabularDataset(tmp_path / "in.parquet", m, target="y", n_buckets=4)
    assert "code" not in ds.feature_names and "code#0" in ds.feature_names  # a string, not a number


def test_kept_csv_numbers_are_scanned_as_numbers_and_redacted_in_their_text(tmp_path: Path) -> None:
    """A kept column of digits is scanned as pyarrow types it (whole-value card numbers), also
    with leading zeros; redact_values replaces the finding and keeps every other cell's text."""
    (tmp_path / "in.csv").write_text("id,ref\n1,007\n2,0004111111111111111\n3,\n")
    p = {"policy_version": "1", "columns": [{"name": "id", "action": "tokenize"}], "default": {"action": "keep"}}
    with pytest.raises(PIIDetectedError, match=r"'ref'.*pan x1"):
        TabularMasker(load_policy(data=p), KEY).read_masked(tmp_path / "in.csv")
    redact = TabularMasker(load_policy(data={**p, "detectors": {"on_detect": "redact_values"}}), KEY)
    out, report = redact.read_masked(tmp_path / "in.csv")
    assert out.column("ref").to_pylist() == ["007", "[PAN]", None]
    assert is_csv_text(out.schema.field("ref"))


def test_same_row_scrub_looks_for_the_id_as_written(tmp_path: Path) -> None:
    """A dropped id column of digits was typed as integers: the scrub looked for 7 (too short,
    and not a word of "ref 007"), and the memo kept the customer's id."""
    (tmp_path / "in.csv").write_text("acct,memo\n007,ref 007 paid\n0815,standing order 0815\n")
    p = load_policy(data={"policy_version": "1", "columns": [{"name": "acct", "action": "drop"},
                                                             {"name": "memo", "action": "keep"}]})
    out, report = TabularMasker(p, KEY).read_masked(tmp_path / "in.csv")
    assert out.column("memo").to_pylist() == ["ref [ACCT] paid", "standing order [ACCT]"]


def test_generalised_csv_columns_are_as_before(tmp_path: Path) -> None:
    """Generalising needs values: they are those of pyarrow's typed read ("1e3" is 1000, "NA" is
    missing, ISO dates and timestamps are dates)."""
    (tmp_path / "in.csv").write_text(
        "id,bal,when,at\n1,1e3,2023-04-01,2023-04-01 12:00:00\n2,NA,2023-05-02,2023-05-02T01:00:00\n3,,,\n"
        "4,-5,2024-01-31,NA\n")
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "id", "action": "tokenize"}, {"name": "bal", "action": "generalize", "bins": [0, 1000]},
        {"name": "when", "action": "generalize", "granularity": "month"},
        {"name": "at", "action": "generalize", "granularity": "year"}]})
    m = TabularMasker(p, KEY)
    out, _ = m.read_masked(tmp_path / "in.csv")
    typed = pacsv.read_csv(tmp_path / "in.csv", convert_options=pacsv.ConvertOptions(
        column_types={"id": pa.string()}, strings_can_be_null=False))
    assert out.equals(m.mask_table(typed))
    assert out.column("bal").to_pylist() == ["[1000,inf)", None, None, "(-inf,0)"]
    assert out.column("when").to_pylist() == ["2023-04", "2023-05", None, "2024-01"]
    assert out.column("at").to_pylist() == ["2023", "2023", None, None]
    assert not any(is_csv_text(f) for f in out.schema)  # generalised output is not the file's text


def test_not_utf8_names_the_columns(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_bytes(b"id,city,street\n1,M\xfcnchen,x\n2,Berlin,Stra\xdfe\n")
    p = load_policy(data={"policy_version": "1", "columns": [{"name": "id", "action": "tokenize"}],
                          "default": {"action": "keep"}})
    with pytest.raises(MalformedTableError, match=r"city, street are not valid UTF-8") as info:
        TabularMasker(p, KEY).read_masked(tmp_path / "a.csv")
    assert "nchen" not in str(info.value) and CSV_TEXT_KEY not in str(info.value).encode()

"""TabularMasker: no PII survives, determinism per key, generalisation, fail-closed, attacks."""

from __future__ import annotations

import datetime as dt
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.masking.tabular.errors import (
    MalformedTableError,
    MaskKeyError,
    PIIDetectedError,
    UnmaskedColumnError,
    UnsupportedFormatError,
)
from securetrain.masking.tabular.masker import METADATA_KEY, TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.synthetic import PII_COLUMNS, generate_finance_table, write_finance_file
from securetrain.masking.tabular.transforms import INVALID_PAN

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "policies" / "finance-pii.yaml"
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _pii_values(table: pa.Table) -> set[str]:
    """Every original PII string, plus the forms that would still identify (PAN digits, local parts)."""
    values: set[str] = set()
    for col in PII_COLUMNS:
        for v in table.column(col).to_pylist():
            values.add(v)
    for v in table.column("email").to_pylist():
        values.add(v.split("@")[0])
    for v in table.column("card_number").to_pylist():
        values.add(v[:12])  # anything beyond the last 4 digits is forbidden
    for v in table.column("phone").to_pylist():
        values.add(v.replace("-", "").lstrip("+"))
    return values


@pytest.fixture(scope="module")
def masker() -> TabularMasker:
    return TabularMasker(POLICY, KEY)


def _policy(**extra: object) -> dict:
    return {"policy_version": "t1", "columns": [{"name": "id", "action": "tokenize"}], **extra}


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_no_original_pii_in_output_bytes(tmp_path: Path, masker: TabularMasker, suffix: str) -> None:
    src = write_finance_file(tmp_path / f"in{suffix}", 400, seed=11)
    original = generate_finance_table(400, seed=11)
    for out_suffix in (".csv", ".parquet"):
        dst = tmp_path / f"out{out_suffix}"
        report = masker.mask_file(src, dst)
        data = dst.read_bytes()
        if out_suffix == ".parquet":  # also the decompressed view: zstd pages could hide matches
            data += pq.read_table(dst).to_string(show_metadata=True, preview_cols=100).encode()
            data += "\n".join(map(str, pq.read_table(dst).to_pylist())).encode()
        leaks = [v for v in _pii_values(original) if v.encode() in data]
        assert not leaks, leaks[:5]
        assert report.rows == 400 and "notes" not in report.output_columns
        assert (dst.stat().st_mode & 0o077) == 0  # owner-only


def test_last4_tokens_and_months_are_what_was_promised(masker: TabularMasker) -> None:
    t = generate_finance_table(50, seed=3)
    out = masker.mask_table(t)
    for orig, masked in zip(t.column("card_number").to_pylist(), out.column("card_number").to_pylist()):
        assert masked == "************" + orig[-4:]
    for orig, masked in zip(t.column("txn_date").to_pylist(), out.column("txn_date").to_pylist()):
        assert masked == f"{orig.year:04d}-{orig.month:02d}"
    for masked in out.column("customer_id").to_pylist():
        assert masked.startswith("tok_") and len(masked) == 4 + 16
    for orig, masked in zip(t.column("email").to_pylist(), out.column("email").to_pylist()):
        assert masked.endswith("@" + orig.split("@")[1]) and orig.split("@")[0] not in masked
    meta = out.schema.metadata[METADATA_KEY].decode()
    assert masker.policy_digest in meta and masker.key_id in meta


def test_same_key_same_tokens_different_key_different() -> None:
    t = generate_finance_table(100, seed=5)
    a = TabularMasker(POLICY, KEY).mask_table(t)
    b = TabularMasker(POLICY, KEY).mask_table(t)
    c = TabularMasker(POLICY, OTHER_KEY).mask_table(t)
    assert a.equals(b)
    for col in ("customer_name", "customer_id", "iban", "email", "phone"):
        assert a.column(col) != c.column(col)
        assert not set(a.column(col).to_pylist()) & set(c.column(col).to_pylist())
    # Equal inputs -> equal tokens (joinable), distinct inputs -> distinct tokens.
    names = t.column("customer_name").to_pylist()
    toks = a.column("customer_name").to_pylist()
    assert len(set(zip(names, toks))) == len(set(names)) == len(set(toks))


def test_tokens_normalised_and_domain_separated() -> None:
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "a", "action": "tokenize"}, {"name": "b", "action": "tokenize"},
        {"name": "c", "action": "tokenize", "domain": "other"}]})
    out = TabularMasker(p, KEY).mask_table(pa.table({"a": [" x1 "], "b": ["x1"], "c": ["x1"]}))
    assert out.column("a")[0] == out.column("b")[0]  # strip + same domain: joinable
    assert out.column("a")[0] != out.column("c")[0]  # another domain: not linkable


def test_csv_ids_keep_leading_zeros(tmp_path: Path) -> None:
    p = load_policy(data=_policy(columns=[{"name": "id", "action": "tokenize"}, {"name": "v", "action": "keep"}]))
    m = TabularMasker(p, KEY)
    (tmp_path / "a.csv").write_text("id,v\n007,1\n7,2\n")
    m.mask_file(tmp_path / "a.csv", tmp_path / "a.parquet")
    toks = pq.read_table(tmp_path / "a.parquet").column("id").to_pylist()
    assert toks[0] != toks[1]  # '007' was not parsed into the integer 7
    assert toks == m.mask_table(pa.table({"id": ["007", "7"], "v": [1, 2]})).column("id").to_pylist()


def test_csv_empty_cells_of_text_rule_columns_stay_missing(tmp_path: Path) -> None:
    """Text-rule columns are read from CSV as strings (to keep '007'), and their empty cells came
    through as "" instead of null: every row without an id got the same real-looking token (one
    made-up entity, joinable across tables), an empty e-mail counted as invalid. Nulls stay null,
    as in Parquet and in every other CSV column."""
    p = load_policy(data=_policy(columns=[{"name": "id", "action": "tokenize"},
                                          {"name": "mail", "action": "email"},
                                          {"name": "v", "action": "keep"}]))
    m = TabularMasker(p, KEY)
    (tmp_path / "a.csv").write_text('id,mail,v\n007,a@b.com,1\n,,2\n"",x@y.org,3\n')
    out, report = m.read_masked(tmp_path / "a.csv")
    ids, mails = out.column("id").to_pylist(), out.column("mail").to_pylist()
    assert ids[0] is not None and ids[1] is None and ids[2] is None
    assert mails[1] is None and mails[2].endswith("@y.org")
    by_col = {c.column: c for c in report.columns}
    assert by_col["id"].nulls == 2 and by_col["mail"].nulls == 1 and by_col["mail"].invalid == 0
    parquet = pa.table({"id": ["007", None, None], "mail": ["a@b.com", None, "x@y.org"], "v": [1, 2, 3]})
    assert m.mask_table(parquet).column("id").to_pylist() == ids  # same as the Parquet/null input


def test_csv_header_wider_than_64_kib(tmp_path: Path) -> None:
    """The header was read from the first 64 KiB only: a wide table (6,000 feature columns) was
    refused for a truncated column name that does not exist ("fe"), and text-rule columns past the
    cut were not read as text (leading zeros lost)."""
    names = [f"feature_{i:05d}" for i in range(6000)] + ["cid"]
    (tmp_path / "w.csv").write_text(",".join(names) + "\n" + ",".join(["1"] * 6000 + ["007"]) + "\n"
                                    + ",".join(["2"] * 6000 + ["7"]) + "\n")
    p = load_policy(data={"policy_version": "1", "columns": [{"glob": "feature_*", "action": "keep"},
                                                             {"name": "cid", "action": "tokenize"}]})
    m = TabularMasker(p, KEY)
    out, _ = m.read_masked(tmp_path / "w.csv")
    assert out.num_columns == 6001
    assert out.column("cid").to_pylist() == m.mask_table(pa.table({"cid": ["007", "7"]})).column("cid").to_pylist()


def test_nan_in_float_identifier_columns_is_missing() -> None:
    """Float id columns (an integer id column with gaps) had NaN tokenised as the text "nan": every
    row without an id shared one real-looking token (one made-up entity, joinable across tables)."""
    p = load_policy(data=_policy(columns=[{"name": "id", "action": "tokenize"}, {"name": "tel", "action": "phone"},
                                          {"name": "ssn", "action": "redact"}]))
    t = pa.table({"id": [1234.0, float("nan"), float("nan")], "tel": [2025550143.0, float("nan"), 2025550143.0],
                  "ssn": [float("nan"), 123456789.0, None]})
    out, report = TabularMasker(p, KEY).mask_table_with_report(t)
    assert out.column("id").to_pylist()[1:] == [None, None]
    assert out.column("id")[0].as_py() == TabularMasker(p, KEY).mask_table(pa.table({"id": [1234]})).column("id")[0].as_py()
    assert out.column("tel").to_pylist()[1] is None and out.column("ssn").to_pylist() == [None, "[REDACTED]", None]
    assert {c.column: c.invalid for c in report.columns}["tel"] == 0


def test_bins_and_year() -> None:
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "amt", "action": "generalize", "bins": [0, 1000, 5000]},
        {"name": "s", "action": "generalize", "bins": [0.5]},
        {"name": "d", "action": "generalize", "granularity": "year"},
        {"name": "ts", "action": "generalize", "granularity": "month"},
        {"name": "ds", "action": "generalize", "granularity": "month", "date_format": "%d/%m/%Y"}]})
    t = pa.table({
        "amt": pa.array([-1, 0, 999.99, 1000, 4999, 5000, 10**7, None], pa.float64()),
        "s": pa.array(["0.1", "0.5", " 2 ", None, "0", "1", "0.49", "0.51"]),
        "d": pa.array([dt.date(1999, 12, 31)] * 7 + [None]),
        "ts": pa.array([dt.datetime(2020, 2, 29, 23, 59)] * 8, pa.timestamp("us")),
        "ds": pa.array(["31/01/2024"] * 8),
    })
    out = TabularMasker(p, KEY).mask_table(t)
    assert out.column("amt").to_pylist() == ["(-inf,0)", "[0,1000)", "[0,1000)", "[1000,5000)", "[1000,5000)",
                                             "[5000,inf)", "[5000,inf)", None]
    assert out.column("s").to_pylist() == ["(-inf,0.5)", "[0.5,inf)", "[0.5,inf)", None, "(-inf,0.5)",
                                           "[0.5,inf)", "(-inf,0.5)", "[0.5,inf)"]
    assert out.column("d").to_pylist() == ["1999"] * 7 + [None]
    assert set(out.column("ts").to_pylist()) == {"2020-02"}
    assert set(out.column("ds").to_pylist()) == {"2024-01"}


def test_empty_cells_of_generalised_text_columns_are_missing_not_refused(tmp_path: Path) -> None:
    """A CSV date column in a format pyarrow does not infer (dd/mm/yyyy) stays text, and its empty
    cells came through as "" rather than null: strptime failed and the whole table was refused,
    although the same empty cell in an ISO date or numeric column is simply missing."""
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "id", "action": "tokenize"},
        {"name": "opened", "action": "generalize", "granularity": "year", "date_format": "%d/%m/%Y"},
        {"name": "bal", "action": "generalize", "bins": [0, 100]}]})
    m = TabularMasker(p, KEY)
    (tmp_path / "a.csv").write_text("id,opened,bal\n1,31/01/2024,5\n2,,x\n3, ,7\n".replace(",x", ","))
    out, _ = m.read_masked(tmp_path / "a.csv")
    assert out.column("opened").to_pylist() == ["2024", None, None]
    t = pa.table({"opened": ["31/01/2024", "", "  "], "bal": ["5", "", " "], "id": ["1", "2", "3"]})
    out = m.mask_table(t)
    assert out.column("opened").to_pylist() == ["2024", None, None]
    assert out.column("bal").to_pylist() == ["[0,100)", None, None]
    # A value that is there but does not parse is still refused, naming the format, not the value.
    with pytest.raises(MalformedTableError, match=r"'opened'.*1 value\(s\).*'%d/%m/%Y'") as info:
        m.mask_table(pa.table({"opened": ["31/01/2024", "2024-01-31 Secretname"], "bal": [1, 2], "id": ["1", "2"]}))
    assert "Secretname" not in str(info.value) and "2024-01-31" not in str(info.value)


def test_pan_validation_modes() -> None:
    def run(**rule: object) -> list:
        p = load_policy(data={"policy_version": "1", "columns": [{"name": "pan", "action": "pan", **rule}]})
        return TabularMasker(p, KEY).mask_table(pa.table({"pan": [
            "4111 1111 1111 1111", "4111-1111-1111-1112", "12ab", None, "4111111111111111"]})).column("pan").to_pylist()

    assert run() == ["************1111", INVALID_PAN, INVALID_PAN, None, "************1111"]
    toks = run(mode="tokenize")
    assert toks[0] == toks[4] and toks[0].startswith("tok_") and toks[1] == INVALID_PAN  # formatting-insensitive
    assert run(mode="tokenize_last4")[0].endswith("_1111")
    assert run(validate_luhn=False)[1] == "************1112"
    with pytest.raises(MalformedTableError, match="2 value"):
        run(on_invalid="error")


def test_phone_and_invalid_email() -> None:
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "ph", "action": "phone", "keep_last": 2}, {"name": "em", "action": "email", "keep_domain": False}]})
    out = TabularMasker(p, KEY).mask_table(pa.table({
        "ph": ["+1 (555) 010-2030", "+1-555-010-2030", "12"], "em": ["A.B@X.ORG", "a.b@x.org", "not-an-email"]}))
    ph = out.column("ph").to_pylist()
    assert ph[0] == ph[1] and ph[0].endswith("~30") and ph[2] == "[INVALID_PHONE]"
    em = out.column("em").to_pylist()
    assert em[0] == em[1] and "@" not in em[0] and em[2] == "[INVALID_EMAIL]"


def test_unnamed_column_is_named_in_the_refusal(tmp_path: Path, masker: TabularMasker) -> None:
    """pandas' to_csv writes its index as a column with an empty name; the refusal listed it as
    nothing at all ("...has no default: "), which told the user nothing."""
    (tmp_path / "a.csv").write_text(",customer_id,amount,label\n0,007,1.5,0\n1,008,2.5,1\n")
    with pytest.raises(UnmaskedColumnError) as info:
        masker.read_masked(tmp_path / "a.csv")
    assert "no default: '' (unnamed)" in str(info.value)
    assert "index=False" in (info.value.hint or "")


def test_unknown_column_fails_closed_and_writes_nothing(tmp_path: Path, masker: TabularMasker) -> None:
    t = generate_finance_table(10).append_column("mothers_maiden_name", pa.array(["Smith"] * 10))
    with pytest.raises(UnmaskedColumnError, match="mothers_maiden_name"):
        masker.mask_table(t)
    pq.write_table(t, tmp_path / "in.parquet")
    (tmp_path / "out.parquet").write_bytes(b"previous")
    with pytest.raises(UnmaskedColumnError):
        masker.mask_file(tmp_path / "in.parquet", tmp_path / "out.parquet")
    assert (tmp_path / "out.parquet").read_bytes() == b"previous"  # untouched
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temp files left


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        (["ok", "card 4111 1111 1111 1111 thanks"], "pan"),
        (["ssn 123-45-6789"], "ssn"),
        (["mail me: jane.doe@corp.example"], "email"),
        (["IBAN DE89 3704 0044 0532 0130 00"], "iban"),
        (["ring +1-555-010-9999"], "phone"),
    ],
)
def test_detectors_refuse_unlisted_pii(values: list[str], kind: str) -> None:
    p = load_policy(data=_policy(default={"action": "keep"}))
    with pytest.raises(PIIDetectedError, match=kind) as info:
        TabularMasker(p, KEY).mask_table(pa.table({"id": ["x"] * len(values), "comment": values}))
    for v in values:
        assert v not in str(info.value)  # the refusal never echoes the value


@pytest.mark.parametrize("arr", [
    pa.array([b"ssn 123-45-6789"]),                        # Hive/Impala write strings as plain BINARY
    pa.array([b"ssn 123-45-6789"], pa.large_binary()),
    pa.array(["ssn 123-45-6789"], pa.string_view()),
])
def test_kept_text_of_other_string_types_is_scanned(arr: pa.Array) -> None:
    """Kept binary / string_view columns passed through unscanned, SSNs and all."""
    p = load_policy(data={"policy_version": "1", "columns": [], "default": {"action": "keep"}})
    with pytest.raises(PIIDetectedError, match="'memo'.*ssn x1"):
        TabularMasker(p, KEY).mask_table(pa.table({"memo": arr}))


@pytest.mark.parametrize("arr", [
    pa.array([["john@example.com", "123-45-6789"]]),
    pa.array([{"email": "john@example.com"}]),
    pa.array([[("ssn", "123-45-6789")]], pa.map_(pa.string(), pa.string())),
    pa.array([b"\xff\xfe john@example.com"]),              # bytes that are not UTF-8 text
])
def test_kept_columns_the_detectors_cannot_read_fail_closed(arr: pa.Array) -> None:
    """Nested (list/struct/map) and non-UTF-8 binary columns kept by a rule or the default passed
    through unscanned, PII inside; they are refused unless the policy says scan: false."""
    t = pa.table({"id": ["a"], "blob": arr, "n": [1.5], "d": [dt.date(2020, 1, 1)], "ok": [True]})
    for policy in ({"columns": [{"name": "id", "action": "tokenize"}], "default": {"action": "keep"}},
                   {"columns": [{"name": "id", "action": "tokenize"}, {"name": "blob", "action": "keep"},
                                {"glob": "*", "action": "keep"}]}):
        p = load_policy(data={"policy_version": "1", **policy})
        with pytest.raises(UnmaskedColumnError, match="'blob'.*cannot be scanned") as info:
            TabularMasker(p, KEY).mask_table(t)
        assert "john" not in str(info.value) and "123-45" not in str(info.value)
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "id", "action": "tokenize"}, {"name": "blob", "action": "keep", "scan": False}],
        "default": {"action": "keep"}})
    assert TabularMasker(p, KEY).mask_table(t).column("blob").equals(pa.chunked_array([arr]))


def test_detectors_integer_pan_and_false_positives() -> None:
    p = load_policy(data=_policy(default={"action": "keep"}))
    m = TabularMasker(p, KEY)
    with pytest.raises(PIIDetectedError, match="pan"):
        m.mask_table(pa.table({"id": ["a"], "ref": pa.array([4111111111111111], pa.int64())}))
    # Long order numbers that fail Luhn, and ordinary text, pass.
    ok = m.mask_table(pa.table({"id": ["a", "b"], "ref": pa.array([4111111111111112, 12], pa.int64()),
                                "txt": ["order 4111111111111112", "hello"]}))
    assert ok.column("ref").to_pylist() == [4111111111111112, 12]
    # Explicit keep rules are scanned too, unless they opt out.
    p2 = load_policy(data=_policy(columns=[{"name": "id", "action": "tokenize"}, {"name": "c", "action": "keep"}]))
    with pytest.raises(PIIDetectedError):
        TabularMasker(p2, KEY).mask_table(pa.table({"id": ["a"], "c": ["123-45-6789"]}))
    p3 = load_policy(data=_policy(columns=[{"name": "id", "action": "tokenize"},
                                           {"name": "c", "action": "keep", "scan": False}]))
    assert TabularMasker(p3, KEY).mask_table(pa.table({"id": ["a"], "c": ["123-45-6789"]})).column("c")[0].as_py()


def test_detectors_card_numbers_in_float_columns() -> None:
    """An integer column with one missing value becomes float64 in pandas: card numbers stored
    that way passed a kept column unscanned, while the same numbers as int64 are refused."""
    p = load_policy(data=_policy(default={"action": "keep"}))
    m = TabularMasker(p, KEY)
    with pytest.raises(PIIDetectedError, match="'ref'.*pan x1"):
        m.mask_table(pa.table({"id": ["a", "b"], "ref": pa.array([4111111111111111.0, None], pa.float64())}))
    with pytest.raises(PIIDetectedError, match="'ref'.*pan x1"):
        m.mask_table(pa.table({"id": ["a", "b"], "ref": pa.array([4111111111111111.0, float("nan")])}))
    ok = m.mask_table(pa.table({"id": ["a", "b", "c"],
                                "ref": pa.array([4111111111111112.0, 1234.5, float("inf")], pa.float64())}))
    assert ok.column("ref").to_pylist() == [4111111111111112.0, 1234.5, float("inf")]
    p2 = load_policy(data=_policy(default={"action": "keep"}, detectors={"on_detect": "redact_values"}))
    out = TabularMasker(p2, KEY).mask_table(pa.table({"id": ["a", "b"], "ref": [4111111111111111.0, 2.5]}))
    assert out.column("ref").to_pylist() == ["[PAN]", "2.5"]


def test_detectors_redact_values_and_column() -> None:
    p = load_policy(data=_policy(default={"action": "keep"}, detectors={"on_detect": "redact_values"}))
    out, report = TabularMasker(p, KEY).mask_table_with_report(pa.table({
        "id": ["a", "b"], "c": ["pay 4111-1111-1111-1111 to jane@x.example", "ssn 123-45-6789 tel +1-555-010-9999"]}))
    assert out.column("c").to_pylist() == ["pay [PAN] to [EMAIL]", "ssn [SSN] tel [PHONE]"]
    rep = {r.column: r for r in report.columns}["c"]
    assert rep.detections == {"pan": 1, "email": 1, "ssn": 1, "phone": 1} and rep.action == "keep+redact_values"
    p2 = load_policy(data=_policy(default={"action": "keep"}, detectors={"on_detect": "redact_column"}))
    out2 = TabularMasker(p2, KEY).mask_table(pa.table({"id": ["a"], "c": ["123-45-6789"]}))
    assert out2.column("c").to_pylist() == ["[REDACTED]"]


def test_default_redact_and_drop() -> None:
    t = pa.table({"id": ["a"], "x": ["secret"], "y": [1]})
    out = TabularMasker(load_policy(data=_policy(default={"action": "redact"})), KEY).mask_table(t)
    assert out.column("x").to_pylist() == ["[REDACTED]"] and out.column("y").to_pylist() == ["[REDACTED]"]
    out = TabularMasker(load_policy(data=_policy(default={"action": "drop"})), KEY).mask_table(t)
    assert out.column_names == ["id"]


def test_input_metadata_dropped(masker: TabularMasker) -> None:
    t = generate_finance_table(5).replace_schema_metadata({b"owner": b"John Q. Customer"})
    out = masker.mask_table(t)
    assert set(out.schema.metadata) == {METADATA_KEY}


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("bad.csv", b"customer_name,amount\nJohn Secretname,1,EXTRA\n"),
        ("empty.csv", b""),
        ("garbage.parquet", b"not a parquet file at all, John Secretname"),
    ],
)
def test_malformed_input_is_typed_and_withholds_values(tmp_path: Path, name: str, content: bytes) -> None:
    p = load_policy(data={"policy_version": "1", "default": {"action": "keep"}, "detectors": {"enabled": False}})
    src = tmp_path / name
    src.write_bytes(content)
    with pytest.raises(MalformedTableError) as info:
        TabularMasker(p, KEY).mask_file(src, tmp_path / "out.csv")
    assert "Secretname" not in str(info.value)
    assert not (tmp_path / "out.csv").exists()


def test_truncated_parquet(tmp_path: Path, masker: TabularMasker) -> None:
    src = write_finance_file(tmp_path / "in.parquet", 50)
    src.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(MalformedTableError):
        masker.mask_file(src, tmp_path / "out.parquet")


def test_type_mismatch_withholds_values(tmp_path: Path) -> None:
    p = load_policy(data={"policy_version": "1", "columns": [{"name": "d", "action": "generalize", "granularity": "month"}]})
    with pytest.raises(MalformedTableError, match="'d'") as info:
        TabularMasker(p, KEY).mask_table(pa.table({"d": ["2020-01-01", "John Secretname"]}))
    assert "Secretname" not in str(info.value)


def test_csv_output_of_types_csv_cannot_hold(tmp_path: Path) -> None:
    """Masking a Parquet file to .csv ended in a raw pyarrow ArrowInvalid ("Unsupported Type") for a
    kept string_view column (which CSV can hold) and for nested columns kept with scan: false."""
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "id", "action": "tokenize"}, {"name": "tags", "action": "keep", "scan": False}],
        "default": {"action": "keep"}})
    m = TabularMasker(p, KEY)
    pq.write_table(pa.table({"id": ["a"], "sv": pa.array(["x"], pa.string_view())}), tmp_path / "a.parquet")
    m.mask_file(tmp_path / "a.parquet", tmp_path / "a.csv")
    assert (tmp_path / "a.csv").read_text().splitlines()[1].endswith(',x')
    pq.write_table(pa.table({"id": ["a"], "tags": pa.array([[1, 2]])}), tmp_path / "b.parquet")
    (tmp_path / "b.csv").write_bytes(b"previous")
    with pytest.raises(MalformedTableError, match=r"CSV.*tags \(list<"):
        m.mask_file(tmp_path / "b.parquet", tmp_path / "b.csv")
    assert (tmp_path / "b.csv").read_bytes() == b"previous"


def test_csv_that_is_not_utf8_is_refused_as_such(tmp_path: Path) -> None:
    """A Latin-1 CSV: pyarrow reads a kept column with non-UTF-8 bytes as *binary*, which passed
    through unscanned (later: refused as an unscannable type, which hid the cause); a text-rule
    column failed with a hint to check that the file is complete. Both now say: not UTF-8."""
    p = load_policy(data={"policy_version": "1", "columns": [{"name": "id", "action": "tokenize"}],
                          "default": {"action": "keep"}})
    m = TabularMasker(p, KEY)
    for name, content in (("kept", b"id,city\n1,M\xfcnchen Hans\n"), ("token", b"id,city\nM\xfcller,x\n")):
        (tmp_path / f"{name}.csv").write_bytes(content)
        with pytest.raises(MalformedTableError, match="UTF-8") as info:
            m.read_masked(tmp_path / f"{name}.csv")
        assert "UTF-8" in (info.value.hint or "") and "nchen" not in str(info.value) and "ller" not in str(info.value)


def test_duplicate_column_names_are_named(tmp_path: Path, masker: TabularMasker) -> None:
    """The refusal said only "the table has duplicate column names", leaving the user to search a
    wide export for them."""
    (tmp_path / "d.csv").write_text("customer_id,amount,label,amount\n007,1.5,0,2\n")
    with pytest.raises(MalformedTableError, match=r"duplicate column names: amount \(2 times\)"):
        masker.read_masked(tmp_path / "d.csv")


def test_files_and_keys_errors(tmp_path: Path, masker: TabularMasker) -> None:
    with pytest.raises(UnsupportedFormatError):
        masker.mask_file(tmp_path / "x.xlsx", tmp_path / "y.csv")
    with pytest.raises(MalformedTableError, match="not found"):
        masker.mask_file(tmp_path / "missing.csv", tmp_path / "y.csv")
    src = write_finance_file(tmp_path / "a.csv", 5)
    with pytest.raises(Exception, match="onto itself"):
        masker.mask_file(src, src)
    with pytest.raises(MaskKeyError):
        TabularMasker(POLICY, b"short")
    with pytest.raises(MaskKeyError, match="bytes"):
        TabularMasker(POLICY, KEY.hex())  # type: ignore[arg-type]
    assert KEY.hex() not in repr(masker)
    with pytest.raises(TypeError):
        pickle.dumps(masker)


def test_audit_events_have_digests_not_pii(tmp_path: Path) -> None:
    audit = MemoryAuditRecorder()
    m = TabularMasker(POLICY, KEY, audit=audit)
    src = write_finance_file(tmp_path / "in.csv", 30)
    report = m.mask_file(src, tmp_path / "out.parquet")
    actions = [e["action"] for e in audit.events]
    assert actions == ["tabular.read", "mask.policy_applied", "tabular.write"]
    import hashlib

    assert audit.events[0]["details"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    applied = audit.events[1]["details"]
    assert applied["policy_version"] == "1.1.0" and applied["policy_digest"] == m.policy_digest
    assert audit.events[2]["details"]["sha256"] == report.output_sha256
    blob = repr(audit.events)
    assert not [v for v in _pii_values(generate_finance_table(30)) if v in blob]
    assert KEY.hex() not in blob
    with pytest.raises(UnmaskedColumnError):
        m.mask_table(pa.table({"zzz": [1]}))
    assert audit.events[-1]["outcome"] == "refused"

"""Validated detectors on kept columns (cards, IBANs, phones, names), same-row scrubbing, and
`securetrain mask` with the shipped policy and an audit database."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from securetrain.errors import ConfigError
from securetrain.masking.tabular.cli import register
from securetrain.masking.tabular.errors import PIIDetectedError
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.synthetic import generate_finance_table, write_finance_file

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "policies" / "finance-pii.yaml"
KEY = bytes(range(32))


def _masker(on_detect: str = "refuse", **detectors: object) -> TabularMasker:
    return TabularMasker(load_policy(data={
        "policy_version": "t", "columns": [{"name": "id", "action": "tokenize"}],
        "default": {"action": "keep"}, "detectors": {"on_detect": on_detect, **detectors}}), KEY)


def _redacted(texts: list[str], **detectors: object) -> tuple[list[str], dict[str, int]]:
    out, report = _masker("redact_values", **detectors).mask_table_with_report(
        pa.table({"id": [str(i) for i in range(len(texts))], "txt": texts}))
    return out.column("txt").to_pylist(), {c.column: c for c in report.columns}["txt"].detections


def test_every_card_number_in_a_cell_is_luhn_checked() -> None:
    text = "order 1234567812345678 paid with card 4111111111111111"
    with pytest.raises(PIIDetectedError, match="pan") as info:
        _masker().mask_table(pa.table({"id": ["a"], "txt": [text]}))
    assert "4111" not in str(info.value)
    out, det = _redacted([text, "ref 1234567812345678 and 4111-1111-1111-1111 and 5500 0000 0000 0004"])
    assert out == ["order 1234567812345678 paid with card [PAN]", "ref 1234567812345678 and [PAN] and [PAN]"]
    assert det == {"pan": 2}
    # Order numbers alone (Luhn-invalid) pass in refuse mode.
    _masker().mask_table(pa.table({"id": ["a"], "txt": ["order 1234567812345678 shipped"]}))


@pytest.mark.parametrize("iban", [
    "DE89 3704 0044 0532 0130 00", "de89370400440532013000", "de89-3704-0044-0532-0130-00",
    "GB82 WEST 1234 5698 7654 32", "gb82-west-1234-5698-7654-32", "FR14 2004 1010 0505 0001 3M02 606",
])
def test_valid_ibans_found_in_any_case_and_form(iban: str) -> None:
    with pytest.raises(PIIDetectedError, match="iban"):
        _masker().mask_table(pa.table({"id": ["a"], "txt": [f"refund to {iban} today"]}))
    out, _ = _redacted([f"refund to {iban} today"])
    assert out == ["refund to [IBAN] today"]


@pytest.mark.parametrize("bad", ["DE88 3704 0044 0532 0130 00", "de89-3704-0044-0532-0130-01", "XX89 3704 0044 0532 01"])
def test_ibans_with_wrong_checksum_are_not_flagged(bad: str) -> None:
    out, det = _redacted([f"iban {bad} wrong"], detectors=["iban", "pan"])
    assert out == [f"iban {bad} wrong"] and det == {}


@pytest.mark.parametrize(("text", "phone"), [
    ("call 020 7946 0958 now", "020 7946 0958"),          # UK national
    ("mobile 07700 900123", "07700 900123"),
    ("ruf an: 030 12345678", "030 12345678"),              # German national
    ("Handy 0151 23456789", "0151 23456789"),
    ("intl +44 20 7946 0958", "+44 20 7946 0958"),
    ("tel +49 30 12345678", "+49 30 12345678"),
    ("US (212) 555-0199", "(212) 555-0199"),
])
def test_uk_german_and_us_phone_numbers_found(text: str, phone: str) -> None:
    with pytest.raises(PIIDetectedError, match="phone"):
        _masker().mask_table(pa.table({"id": ["a"], "txt": [text]}))
    out, _ = _redacted([text])
    assert phone not in out[0] and "[PHONE]" in out[0]


def test_phone_regions_come_from_the_policy() -> None:
    # A French national number is only recognised when FR is a configured region.
    text = ["appelez 01 42 68 53 00"]
    assert _redacted(text, phone_regions=["FR"])[0] == ["appelez [PHONE]"]
    assert _redacted(text, phone_regions=["US"])[0] == text
    with pytest.raises(ConfigError, match="phone_regions"):
        _masker(phone_regions=["ZZ"])


def test_dates_amounts_and_ids_are_not_phone_numbers() -> None:
    texts = ["paid on 2023-04-01 ref 20230401 amount 1234.56", "id C123456789 qty 3", "grocery"]
    out, det = _redacted(texts)
    assert out == texts and det == {}


def test_names_in_free_text_found_by_presidio_patterns() -> None:
    texts = ["transfer to John Smith please", "Dear Mrs Okafor, thanks", "paid to Amazon", "weekly groceries"]
    with pytest.raises(PIIDetectedError, match="person"):
        _masker().mask_table(pa.table({"id": ["a"], "txt": texts[:1]}))
    out, det = _redacted(texts)
    assert out == ["transfer to [PERSON] please", "Dear Mrs [PERSON], thanks", "paid to Amazon", "weekly groceries"]
    assert det == {"person": 2}


def test_presidio_runs_without_any_spacy_model() -> None:
    import spacy.util

    from securetrain.masking.tabular.detectors import TextScanner

    scanner = TextScanner(["person"])
    assert [f.kind for f in scanner.findings("transfer to Jane Doe")] == ["person"]
    assert scanner._person is not None
    assert type(scanner._person._engine.nlp_engine).__name__ == "NoOpNlpEngine"
    assert not [m for m in ("en_core_web_lg", "en_core_web_sm") if spacy.util.is_package(m)]


def test_same_row_identifiers_scrubbed_from_kept_text() -> None:
    policy = load_policy(POLICY)
    policy = policy.model_copy(update={"columns": [
        *policy.columns, *load_policy(data={"policy_version": "x", "columns": [
            {"name": "memo", "action": "keep"}]}).columns]})
    t = generate_finance_table(300, seed=9)
    names = t.column("customer_name").to_pylist()
    ids = t.column("customer_id").to_pylist()
    memo = [f"transfer to {n.lower() if i % 3 == 0 else n} ref {c}" if i % 2 else "standing order"
            for i, (n, c) in enumerate(zip(names, ids))]
    memo[4] = f"Mr {names[4].split()[1]} called"  # a part of the name alone
    out, report = TabularMasker(policy, KEY).mask_table_with_report(t.append_column("memo", pa.array(memo)))
    got = out.column("memo").to_pylist()
    for i, text in enumerate(got):
        assert names[i].lower() not in text.lower() and ids[i] not in text
        for part in names[i].split():
            assert part.lower() not in text.lower()
    assert got[1] == "transfer to [CUSTOMER_NAME] ref [CUSTOMER_ID]"
    assert got[0] == "standing order"
    rep = {c.column: c for c in report.columns}["memo"]
    assert rep.detections == {"row_value": 151} and rep.action == "keep+scrub_row_values"


def test_row_values_refuse_and_off() -> None:
    base = {"policy_version": "t", "columns": [{"name": "name", "action": "tokenize"}, {"name": "note", "action": "keep"}]}
    t = pa.table({"name": ["Zed Quorra", "Ann Lee"], "note": ["hello quorra", "no match"]})
    with pytest.raises(PIIDetectedError, match="identifier"):
        TabularMasker(load_policy(data={**base, "detectors": {"row_values": "refuse"}}), KEY).mask_table(t)
    off = TabularMasker(load_policy(data={**base, "detectors": {"row_values": "off", "detectors": ["pan"]}}), KEY)
    assert off.mask_table(t).column("note").to_pylist() == ["hello quorra", "no match"]
    on = TabularMasker(load_policy(data={**base, "detectors": {"detectors": ["pan"]}}), KEY)
    assert on.mask_table(t).column("note").to_pylist() == ["hello [NAME]", "no match"]


def test_known_names_from_other_rows_are_persons() -> None:
    policy = load_policy(data={"policy_version": "t", "columns": [
        {"name": "customer_name", "action": "tokenize"}, {"name": "memo", "action": "keep"}],
        "detectors": {"on_detect": "redact_values"}})
    t = pa.table({"customer_name": ["Ottilie Grundlehner", "Barnaby Fitzwilliam"],
                  "memo": ["gift for barnaby fitzwilliam", "lunch"]})
    out = TabularMasker(policy, KEY).mask_table(t)
    assert out.column("memo").to_pylist() == ["gift for [PERSON]", "lunch"]


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_cli_mask_with_shipped_policy_and_audit_db_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column names such as 'ssn' are recorded as values, so the audit filter accepts the event."""
    from securetrain.audit.log import AuditLog

    src = write_finance_file(tmp_path / "in.csv", 60)
    db = tmp_path / "audit.db"
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", KEY.hex())
    res = CliRunner().invoke(_app(), ["mask", str(src), str(tmp_path / "out.parquet"), "--policy", str(POLICY),
                                      "--audit-db", str(db)])
    assert res.exit_code == 0, (res.output, res.exception)
    with AuditLog(db) as log:
        entries = list(log.entries())
        report = log.verify()
    assert report.ok, report.error
    applied = [e for e in entries if e.action == "mask.policy_applied"]
    assert len(applied) == 1
    actions = applied[0].details["actions"]
    assert {"column": "ssn", "action": "redact"} in actions
    assert [a["column"] for a in actions] == generate_finance_table(1).column_names


def test_detector_only_runs_where_its_prefilter_matched() -> None:
    from securetrain.masking.tabular.detectors import TextScanner

    scanner = TextScanner(["pan", "phone", "person"])
    masks, redacted = scanner.scan(pa.array(["order 1234567812345678", "qty 3", None]))
    assert masks == {} and redacted is None
    assert scanner._person is None  # Presidio was never needed, so never loaded


def test_chunked_columns_with_nulls_are_scanned_and_scrubbed_per_row() -> None:
    policy = load_policy(data={"policy_version": "t", "columns": [
        {"name": "name", "action": "drop"}, {"name": "memo", "action": "keep"}],
        "detectors": {"on_detect": "redact_values"}})
    a = pa.table({"name": ["Zed Quorra", None, "Ann Lee"], "memo": ["hi Zed Quorra", "x", None]})
    b = pa.table({"name": ["Ann Lee", "Bo Li"], "memo": ["card 4111 1111 1111 1111 for ann lee", "ZED QUORRA"]})
    t = pa.concat_tables([a, b])
    assert t.column("memo").num_chunks == 2
    out = TabularMasker(policy, KEY).mask_table(t)
    # Row 4's "ZED QUORRA" is not that row's name, but a known name of the table -> [PERSON].
    assert out.column("memo").to_pylist() == [
        "hi [NAME]", "x", None, "card [PAN] for [NAME]", "[PERSON]"]
    assert out.column_names == ["memo"]


def test_integer_columns_only_flag_whole_card_numbers() -> None:
    t = pa.table({"id": ["a", "b", "c", "d"],
                  "ref": pa.array([4111111111111111, 4111111111111112, -4111111111111111, None], pa.int64()),
                  "small": pa.array([1, 2, 3, 4], pa.int8())})
    out, report = _masker("redact_values").mask_table_with_report(t)
    assert out.column("ref").to_pylist() == ["[PAN]", "4111111111111112", "-4111111111111111", None]
    assert out.column("small").to_pylist() == [1, 2, 3, 4]
    assert {c.column: c.detections for c in report.columns}["ref"] == {"pan": 1}


def test_odd_text_columns_empty_null_large_dictionary_and_case_mapping() -> None:
    policy = load_policy(data={"policy_version": "t", "columns": [
        {"name": "name", "action": "tokenize"}, {"name": "cid", "action": "drop"}],
        "default": {"action": "keep"}, "detectors": {"on_detect": "redact_values"}})
    m = TabularMasker(policy, KEY)
    empty = pa.table({"name": pa.array([], pa.string()), "cid": pa.array([], pa.int64()), "txt": pa.array([], pa.string())})
    assert m.mask_table(empty).column("txt").to_pylist() == []
    nulls = pa.table({"name": [None, None], "cid": [None, None], "txt": pa.array([None, None], pa.string())})
    assert m.mask_table(nulls).column("txt").to_pylist() == [None, None]
    # 'İ' lower-cases to two code points: the scrub must still find the name, in any case.
    large = pa.table({"name": ["İsmail Öztürk", "Ann Lee"], "cid": [123456, 7],
                      "txt": pa.array(["pay İSMAİL ÖZTÜRK id 123456", "ann lee 7"], pa.large_string())})
    assert m.mask_table(large).column("txt").to_pylist() == ["pay [NAME] id [CID]", "[NAME] 7"]
    dictionary = pa.table({"name": ["Zed Quorra"] * 3, "cid": [1, 2, 3],
                           "txt": pa.array(["hello zed quorra", "x", "call +44 20 7946 0958"]).dictionary_encode()})
    assert m.mask_table(dictionary).column("txt").to_pylist() == ["hello [NAME]", "x", "call [PHONE]"]

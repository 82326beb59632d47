"""The writer's fast canonical JSON (json's C encoder, and ``entry_bytes`` for whole entries) is
byte-identical to RFC 8785 (rfc8785) on everything the writer hashes: validated details and entry
objects."""

from __future__ import annotations

import random

import pytest
import rfc8785

from securetrain.audit import canonical as canon
from securetrain.audit.errors import AuditEventError

# Characters that stress escaping and key order: ASCII controls, quote, backslash, DEL, C1, U+2028,
# BMP characters above the surrogate block (sorted differently from astral ones under UTF-16), astral.
ALPHABET = (
    [chr(c) for c in range(0x00, 0x80)] + ["\x7f", "\x85", "\u00e9", "\u2028", "\u2029", "\ud7ff", "\ue000",
                                           "\uffee", "\uffff", "\U0001f600", "\U00010000", "\U0010ffff", "中"]
)


def _text(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, n)))


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**53 - 1, -(2**53 - 1), rng.randint(-10**12, 10**12)])
    if kind in (3, 4):
        return _text(rng)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_text(rng, 5) or "k": _value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def test_fast_encoding_equals_rfc8785_on_generated_objects() -> None:
    rng = random.Random(20261204)
    checked = 0
    for _ in range(3000):
        obj = {_text(rng, 6): _value(rng) for _ in range(rng.randint(0, 6))}
        try:
            expected = rfc8785.dumps(obj)
        except (rfc8785.CanonicalizationError, UnicodeError):
            with pytest.raises(AuditEventError):  # no canonical form (lone surrogate...): same typed error
                canon.canonical_bytes_validated(obj)
            continue
        assert canon.canonical_bytes_validated(obj) == expected, obj
        checked += 1
    assert checked > 1000  # most generated objects have a canonical form


def test_key_order_beyond_the_bmp_follows_utf16_not_code_points() -> None:
    # U+FFEE sorts after U+1F600 by code point but before it in UTF-16 (0xD83D < 0xFFEE): JCS wins.
    obj = {"\uffee": 1, "\U0001f600": 2}
    assert canon.canonical_bytes_validated(obj) == rfc8785.dumps(obj)
    assert list(__import__("json").loads(canon.canonical_bytes_validated(obj))) == ["\U0001f600", "\uffee"]


def test_entry_objects_and_validated_details_hash_as_before() -> None:
    clean, data = canon.validated_details({"rows": 1000, "sha256": "ab" * 32, "score": 0.25, "nested": {"b": [1, "x"]}})
    assert clean["score"] == "0.25" and data == rfc8785.dumps(clean)
    obj = canon.entry_object(seq=7, ts=canon.utc_timestamp(), actor="alice", hostname="h\u00f6st", mac="00:11:22:33:44:55",
                             action="dicom.read", resource="sha256:" + "0" * 64, outcome="success", details=clean,
                             prev_hash="f" * 64, server_view={"addr": None, "role": "writer", "time": "2026-12-04T00:00:00Z"})
    assert canon.canonical_bytes_validated(obj) == rfc8785.dumps(obj) == canon.canonical_bytes(obj)


def test_details_limits_still_hold() -> None:
    with pytest.raises(AuditEventError, match="bytes, limit"):
        canon.validated_details({"blob": "x" * (canon.MAX_DETAILS_BYTES + 1)})
    with pytest.raises(AuditEventError, match="secret"):
        canon.validated_details({"api_token": "t"})


def _entry(rng: random.Random) -> dict:
    return dict(seq=rng.choice([0, 1, 2**53 - 1, rng.randint(0, 10**9)]), ts=_text(rng, 30) or "t",
                actor=_text(rng), hostname=_text(rng), mac=_text(rng), action=_text(rng), resource=_text(rng, 40),
                outcome=_text(rng), prev_hash=_text(rng, 64))


def test_entry_bytes_equal_rfc8785_of_the_entry_object() -> None:
    rng = random.Random(20261205)
    checked = 0
    for i in range(3000):
        fields = _entry(rng)
        details = {_text(rng, 6): _value(rng) for _ in range(rng.randint(0, 5))}
        view = None if i % 3 else {"addr": rng.choice([None, "10.0.0.7"]), "role": _text(rng), "time": _text(rng)}
        obj = canon.entry_object(**fields, details=details, server_view=view)
        try:
            expected = rfc8785.dumps(obj)
        except (rfc8785.CanonicalizationError, UnicodeError):
            with pytest.raises(AuditEventError):
                canon.entry_bytes(**fields, details_json=canon.canonical_bytes(details).decode(),
                                  server_view_json=None if view is None else canon.canonical_bytes(view).decode())
            continue
        got = canon.entry_bytes(**fields, details_json=canon.canonical_bytes_validated(details).decode(),
                                server_view_json=None if view is None else canon.canonical_bytes_validated(view).decode())
        assert got == expected, obj
        assert got == canon.canonical_bytes_validated(obj)
        checked += 1
    assert checked > 1000


def test_lone_surrogate_in_a_field_is_refused_with_the_typed_error() -> None:
    fields = dict(seq=1, ts="t", actor="a", hostname="h", mac="m", action="x.y", resource="r\ud800", outcome="success",
                  prev_hash="0" * 64)
    with pytest.raises(AuditEventError, match="surrogate"):
        canon.entry_bytes(**fields, details_json="{}")


@pytest.mark.parametrize("seq", [True, 1.0, "1", 2**53, -(2**53)])
def test_seq_must_be_a_plain_integer_in_range(seq: object) -> None:
    # True would print as 1 and hash like the entry with seq 1; json writes it as true.
    with pytest.raises(AuditEventError, match="seq"):
        canon.entry_bytes(seq=seq, ts="t", actor="a", hostname="h", mac="m", action="x.y", resource="r",  # type: ignore[arg-type]
                          outcome="success", details_json="{}", prev_hash="0" * 64)


def test_utc_timestamp_formats_each_second_and_microsecond(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import UTC, datetime, timedelta

    before = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    now = canon.utc_timestamp()
    assert before <= now <= datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    # The cached date and time follow the clock across seconds (and back: a clock set backwards).
    for ns, expected in [(1_700_000_000_999_999_000, "2023-11-14T22:13:20.999999Z"),
                         (1_700_000_001_000_000_000, "2023-11-14T22:13:21.000000Z"),
                         (1_700_000_001_000_042_999, "2023-11-14T22:13:21.000042Z"),
                         (1_600_000_000_000_001_000, "2020-09-13T12:26:40.000001Z")]:
        monkeypatch.setattr(canon.time, "time_ns", lambda ns=ns: ns)
        assert canon.utc_timestamp() == expected
        assert canon.utc_timestamp(datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)) == expected

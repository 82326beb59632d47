"""The writer's fast canonical JSON (json's C encoder) is byte-identical to RFC 8785 (rfc8785) on
everything the writer hashes: validated details and entry objects."""

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

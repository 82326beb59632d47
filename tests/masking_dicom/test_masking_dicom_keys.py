"""Keys, keyed remaps, date shifting and the encrypted pseudonym mapping (incl. attacks)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from dicom_fixtures import OTHER_SECRET, SECRET

from securetrain.errors import IntegrityError
from securetrain.masking.dicom.dates import shift_da, shift_dt
from securetrain.masking.dicom.errors import DeidKeyError, MappingIntegrityError
from securetrain.masking.dicom.keys import DeidKeys, KeyedMapper, parse_key_text
from securetrain.masking.dicom.mapping import decrypt_mapping, encrypt_mapping, export_mapping, load_mapping


def test_subkeys_are_independent_and_hidden() -> None:
    k = DeidKeys.from_secret(SECRET)
    assert len({k.uid_key, k.date_key, k.pseudonym_key}) == 3
    assert SECRET not in (k.uid_key, k.date_key, k.pseudonym_key)
    assert k.uid_key.hex() not in repr(k) and SECRET.hex() not in repr(k)
    assert k.key_id == DeidKeys.from_secret(SECRET).key_id != DeidKeys.from_secret(OTHER_SECRET).key_id


@pytest.mark.parametrize("bad", [b"", b"short", "a string" * 4])
def test_weak_or_wrong_type_secret_rejected(bad: object) -> None:
    with pytest.raises(DeidKeyError):
        DeidKeys.from_secret(bad)  # type: ignore[arg-type]


def test_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DeidKeys.from_env({"SECURETRAIN_DEID_KEY": SECRET.hex()}).key_id == DeidKeys.from_secret(SECRET).key_id
    with pytest.raises(DeidKeyError):
        DeidKeys.from_env({})
    with pytest.raises(DeidKeyError, match="hex"):
        DeidKeys.from_env({"SECURETRAIN_DEID_KEY": SECRET.hex() + "z"})  # a typo is not a new key
    assert parse_key_text(b"  " + SECRET.hex().encode() + b"\n") == SECRET
    assert parse_key_text(SECRET) == SECRET


def test_uid_remap_valid_deterministic_keyed() -> None:
    m = KeyedMapper(DeidKeys.from_secret(SECRET))
    m2 = KeyedMapper(DeidKeys.from_secret(SECRET))
    other = KeyedMapper(DeidKeys.from_secret(OTHER_SECRET))
    uids = [f"1.2.3.4.{i}" for i in range(200)]
    new = [m.uid(u) for u in uids]
    assert new == [m2.uid(u) for u in uids]
    assert len(set(new)) == 200
    assert all(re.fullmatch(r"2\.25\.(0|[1-9]\d{0,38})", u) and len(u) <= 64 for u in new)
    assert all(a != b for a, b in zip(new, (other.uid(u) for u in uids)))


def test_pseudonym_and_offsets() -> None:
    m = KeyedMapper(DeidKeys.from_secret(SECRET), max_shift_days=30)
    p = m.pseudonym("PATIENT-1")
    assert re.fullmatch(r"ST[A-Z2-7]{16}", p) and p == m.pseudonym("PATIENT-1") != m.pseudonym("PATIENT-2")
    offsets = {m.day_offset(m.pseudonym(f"P{i}")) for i in range(300)}
    assert 0 not in offsets and max(offsets) <= 30 and min(offsets) >= -30
    assert any(o > 0 for o in offsets) and any(o < 0 for o in offsets)


@pytest.mark.parametrize(
    "value,days,expected",
    [
        ("20200301", -1, "20200229"),
        ("20191231", 1, "20200101"),
        ("2020", 400, "2021"),
        ("202003", -1, "202002"),
        ("20200101-20200110", 2, "20200103-20200112"),
        ("20200101-", 2, "20200103-"),
        ("", 5, ""),
        ("2020.03.01", 1, "20200302"),
        ("garbage", 1, None),
        ("20201301", 1, None),
    ],
)
def test_shift_da(value: str, days: int, expected: str | None) -> None:
    assert shift_da(value, days) == expected


@pytest.mark.parametrize(
    "value,days,expected",
    [
        ("20200301101530.123456", -1, "20200229101530.123456"),
        ("20200301101530+0100", 1, "20200302101530"),
        ("20200301101530-0500", 1, "20200302101530"),
        ("2020", 1, "2021"),  # year precision always moves (at least one year)
        ("20200101120000-20200102120000", 1, "20200102120000-20200103120000"),  # ranges keep both ends
        ("bad", 1, None),
    ],
)
def test_shift_dt(value: str, days: int, expected: str | None) -> None:
    assert shift_dt(value, days) == expected


def test_mapping_roundtrip_encrypted_atomic(tmp_path: Path) -> None:
    key = os.urandom(32)
    entries = {"PID-7734-QQ": "STAAAA", "Müller^Jörg": "STBBBB"}
    path = export_mapping(tmp_path / "map.bin", entries, key)
    blob = path.read_bytes()
    assert b"PID-7734" not in blob and "Müller".encode() not in blob and b"STAAAA" not in blob
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_mapping(path, key) == entries
    assert [p.name for p in tmp_path.iterdir()] == ["map.bin"]  # no temp/plaintext leftovers
    # two encryptions differ (random nonce)
    assert encrypt_mapping(entries, key) != encrypt_mapping(entries, key)


def test_mapping_attacks(tmp_path: Path) -> None:
    key = os.urandom(32)
    blob = encrypt_mapping({"A": "B"}, key)
    with pytest.raises(MappingIntegrityError):
        decrypt_mapping(blob, os.urandom(32))  # wrong key
    tampered = bytearray(blob)
    tampered[-5] ^= 1
    with pytest.raises(MappingIntegrityError):
        decrypt_mapping(bytes(tampered), key)
    with pytest.raises(MappingIntegrityError):
        decrypt_mapping(blob[:-1], key)  # truncation
    with pytest.raises(MappingIntegrityError):
        decrypt_mapping(blob[:20], key)
    with pytest.raises(IntegrityError):
        decrypt_mapping(b"XXXXXXX\n" + blob[8:], key)  # header swap
    with pytest.raises(DeidKeyError):
        encrypt_mapping({"A": "B"}, b"short")

"""The vectorised transforms equal a plain per-row reference of the documented formats, on random data."""

from __future__ import annotations

import base64
import datetime as dt
import hmac
import random
import re

import pyarrow as pa
import pytest

from securetrain.masking.tabular.hmac_batch import HmacSha256
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.transforms import INVALID_EMAIL, INVALID_PAN, INVALID_PHONE

KEY = bytes(range(32))
K_TOK = hmac.digest(KEY, b"securetrain.tabular.tokenize.v1", "sha256")
ALPHABET = "abcXYZ019 -.@+_éß中\t"
RE2_SPACE = "\t\n\f\r "


def ref_token(value: str, *, domain: str, prefix: str, length: int) -> str:
    mac = hmac.digest(K_TOK, domain.encode() + b"\x00" + value.encode(), "sha256")
    return prefix + base64.b32encode(mac).decode().lower()[:length]


def ref_tokenize(v: str | None, *, normalize: str, domain: str, prefix: str, length: int) -> str | None:
    if v is None:
        return None
    if normalize in ("strip", "strip_lower"):
        v = v.strip()
    if normalize in ("lower", "strip_lower"):
        v = v.lower()
    return ref_token(v, domain=domain, prefix=prefix, length=length)


def ref_luhn(d: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(d)):
        x = int(ch) * (2 if i % 2 else 1)
        total += x - 9 if x > 9 else x
    return total % 10 == 0


def ref_pan(v: str | None, *, mode: str) -> str | None:
    if v is None:
        return None
    digits = v.strip().replace(" ", "").replace("-", "")
    if not re.fullmatch(r"[0-9]{12,19}", digits) or not ref_luhn(digits):
        return INVALID_PAN
    tok = ref_token(digits, domain="pan", prefix="tok_", length=16)
    return {"last4": "************" + digits[-4:], "tokenize": tok, "tokenize_last4": f"{tok}_{digits[-4:]}"}[mode]


def ref_email(v: str | None) -> str | None:
    if v is None:
        return None
    s = v.strip().lower()
    m = re.fullmatch(rf"([^@{RE2_SPACE}]+)@([^@{RE2_SPACE}]+\.[^@{RE2_SPACE}]+)", s)
    if not m:
        return INVALID_EMAIL
    return ref_token(s, domain="email", prefix="tok_", length=12) + "@" + m.group(2)


def ref_phone(v: str | None, keep_last: int) -> str | None:
    if v is None:
        return None
    digits = "".join(ch for ch in v if "0" <= ch <= "9")
    if not 7 <= len(digits) <= 15:
        return INVALID_PHONE
    tok = ref_token(digits, domain="phone", prefix="tok_", length=12)
    return f"{tok}~{digits[-keep_last:]}" if keep_last else tok


def _random_strings(rng: random.Random, n: int) -> list[str | None]:
    out: list[str | None] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.1:
            out.append(None)
        elif r < 0.3:  # card-like
            body = "".join(rng.choice("0123456789") for _ in range(rng.randint(11, 20)))
            out.append(rng.choice(["", " "]) + "-".join(body[i:i + 4] for i in range(0, len(body), 4)))
        elif r < 0.5:  # e-mail-like
            out.append(f"{rng.choice(['A.b', 'x', '', 'a b'])}@{rng.choice(['Ex.org', 'x', 'a.b.c', '.c', 'd.'])}")
        else:
            out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 14))))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transforms_equal_reference_on_random_data(seed: int) -> None:
    rng = random.Random(seed)
    n = 3000
    values = _random_strings(rng, n)
    values[:50] = values[50:100]  # repeated values share one dictionary entry
    table = pa.table({
        "tok": values, "tok_sl": values, "pan_l4": values, "pan_t": values, "pan_tl": values,
        "em": values, "ph": values,
    })
    # Several chunks and a sliced chunk: the offsets handling must not depend on contiguity.
    table = pa.concat_tables([table.slice(0, 700), table.slice(700, 1).slice(0, 1), table.slice(701)])
    policy = load_policy(data={"policy_version": "1", "columns": [
        {"name": "tok", "action": "tokenize", "normalize": "none", "domain": "d1", "prefix": "", "length": 51},
        {"name": "tok_sl", "action": "tokenize", "normalize": "strip_lower", "length": 13, "prefix": "pré-"},
        {"name": "pan_l4", "action": "pan"},
        {"name": "pan_t", "action": "pan", "mode": "tokenize"},
        {"name": "pan_tl", "action": "pan", "mode": "tokenize_last4"},
        {"name": "em", "action": "email"},
        {"name": "ph", "action": "phone", "keep_last": 3},
    ]})
    out = TabularMasker(policy, KEY).mask_table(table)
    assert out.column("tok").to_pylist() == [
        ref_tokenize(v, normalize="none", domain="d1", prefix="", length=51) for v in values]
    assert out.column("tok_sl").to_pylist() == [
        ref_tokenize(v, normalize="strip_lower", domain="default", prefix="pré-", length=13) for v in values]
    assert out.column("pan_l4").to_pylist() == [ref_pan(v, mode="last4") for v in values]
    assert out.column("pan_t").to_pylist() == [ref_pan(v, mode="tokenize") for v in values]
    assert out.column("pan_tl").to_pylist() == [ref_pan(v, mode="tokenize_last4") for v in values]
    assert out.column("em").to_pylist() == [ref_email(v) for v in values]
    assert out.column("ph").to_pylist() == [ref_phone(v, 3) for v in values]


@pytest.mark.parametrize("length", [8, 13, 16, 40, 51])
def test_hmac_and_base32_match_stdlib(length: int) -> None:
    rng = random.Random(length)
    msgs = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))) for _ in range(200)]
    for key in (KEY, b"k" * 64, b"long key " * 20):  # block-size and hashed (> 64 bytes) keys
        assert HmacSha256(key).many(msgs) == b"".join(hmac.digest(key, m, "sha256") for m in msgs)
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "v", "action": "tokenize", "normalize": "none", "length": length}]})
    vals = [f"v{i}" for i in range(300)]
    got = TabularMasker(p, KEY).mask_table(pa.table({"v": vals})).column("v").to_pylist()
    assert got == [ref_token(v, domain="default", prefix="tok_", length=length) for v in vals]


def test_generalised_dates_equal_reference() -> None:
    rng = random.Random(5)
    days = [None if rng.random() < 0.05 else dt.date(1, 1, 1) + dt.timedelta(days=rng.randrange(3_650_000))
            for _ in range(2000)]
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "m", "action": "generalize", "granularity": "month"},
        {"name": "y", "action": "generalize", "granularity": "year"},
        {"name": "ts", "action": "generalize", "granularity": "month"}]})
    stamps = [None if d is None else dt.datetime(d.year, d.month, d.day, 23, 59, 59) for d in days]
    out = TabularMasker(p, KEY).mask_table(pa.table({
        "m": pa.array(days, pa.date32()), "y": pa.array(days, pa.date32()),
        "ts": pa.array(stamps, pa.timestamp("us"))}))
    assert out.column("m").to_pylist() == [None if d is None else f"{d.year:04d}-{d.month:02d}" for d in days]
    assert out.column("y").to_pylist() == [None if d is None else f"{d.year:04d}" for d in days]
    assert out.column("ts").to_pylist() == out.column("m").to_pylist()


def test_base32_of_macs_equals_base64_for_every_length_and_prefix() -> None:
    import os

    from securetrain.masking.tabular.transforms import _b32_prefix

    macs = os.urandom(32 * 37)
    for length in range(1, 53):
        for prefix in ("", "tok_", "pré-"):
            got = _b32_prefix(macs, 37, length, prefix.encode()).to_pylist()
            assert got == [prefix + base64.b32encode(macs[32 * i:32 * i + 32]).decode().lower()[:length]
                           for i in range(37)]


def test_transforms_equal_reference_on_clean_columns() -> None:
    # Well-formed columns take the shortcuts: 16-digit cards without separators (no byte filter
    # copy, Luhn on a fixed-width view, last four from the byte buffer), e-mails whose local part
    # is not ASCII (the domain is cut at a byte position).
    rng = random.Random(7)
    cards = ["".join(rng.choice("0123456789") for _ in range(16)) for _ in range(400)]
    cards += ["4111111111111111", "4012888888881881", "0000000000000000"]
    emails = [f"{rng.choice(['é.ß', 'a', 'Jo.Ann', '中文'])}{i}@{rng.choice(['exämple.org', 'x.io'])}"
              for i in range(len(cards))]
    policy = load_policy(data={"policy_version": "1", "columns": [
        {"name": "pan_l4", "action": "pan"}, {"name": "pan_tl", "action": "pan", "mode": "tokenize_last4"},
        {"name": "pan_nl", "action": "pan", "validate_luhn": False}, {"name": "em", "action": "email"},
    ]})
    with_null = [*cards[:-1], None]  # a null: the general Luhn path
    for column in (cards, with_null):
        table = pa.table({"pan_l4": column, "pan_tl": column, "pan_nl": column, "em": emails})
        out = TabularMasker(policy, KEY).mask_table(table)
        assert out.column("pan_l4").to_pylist() == [ref_pan(v, mode="last4") for v in column]
        assert out.column("pan_tl").to_pylist() == [ref_pan(v, mode="tokenize_last4") for v in column]
        assert out.column("pan_nl").to_pylist() == [
            None if v is None else "************" + v[-4:] for v in column]
        assert out.column("em").to_pylist() == [ref_email(v) for v in emails]
    assert INVALID_PAN in out.column("pan_l4").to_pylist()  # some random cards fail Luhn


def test_shortcuts_are_taken_only_when_exact() -> None:
    from securetrain.masking.tabular import transforms as T

    plain = pa.array(["4111111111111111", "4012888888881881"])
    assert T.keep_bytes(plain, T.NOT_SPACE_OR_DASH) is plain  # nothing to drop: no copy
    assert T.keep_bytes(pa.array(["4111 1111"]), T.NOT_SPACE_OR_DASH).to_pylist() == ["41111111"]
    assert T._common_width(plain) == 16
    assert T._common_width(pa.array(["4111", "41111"])) is None
    assert T._common_width(pa.array(["4111", None])) is None
    assert T._common_width(pa.array(["1" * 20])) is None  # longer than a card number
    assert list(T.luhn_valid(plain)) == [True, True]
    assert list(T.luhn_valid(pa.array(["4111111111111112", "0000000000000000"]))) == [False, True]

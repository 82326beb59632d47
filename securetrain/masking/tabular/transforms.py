"""Vectorised column transforms (pyarrow.compute), one function per policy action.

Everything here works on whole arrays. The only per-value Python work is the HMAC, and that runs
once per *distinct* value (dictionary-encode, tokenise the dictionary, take), so a column with few
distinct values costs almost nothing and a unique-per-row column costs one HMAC per row.

Invalid values (a PAN that fails Luhn, an e-mail without '@') are never passed through: they are
replaced by a fixed marker such as ``[INVALID_PAN]`` or the rule asks for an error.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TOKEN_KEY_LABEL = b"securetrain.tabular.tokenize.v1"
KEY_ID_LABEL = b"securetrain.tabular.key-id.v1"

INVALID_PAN = "[INVALID_PAN]"
INVALID_EMAIL = "[INVALID_EMAIL]"
INVALID_PHONE = "[INVALID_PHONE]"

# RE2 patterns (pyarrow). Order matters for value redaction: longer/more specific shapes first.
DETECTOR_PATTERNS: dict[str, str] = {
    "email": r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}",
    "iban": r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b",
    "pan": r"\b(?:\d[ \-]?){12,18}\d\b",
    "ssn": r"\b\d{3}-\d{2}-\d{4}\b",
    "phone": r"(?:\+\d{1,3}[ .\-]?)?(?:\(\d{3}\)|\b\d{3})[ .\-]\d{3}[ .\-]\d{4}\b|\+\d{1,3}(?:[ .\-]\d{2,4}){2,5}\b",
}


@dataclass
class ColumnStats:
    """Counts for the report; never values."""

    nulls: int = 0
    invalid: int = 0
    distinct: int | None = None
    detections: dict[str, int] = field(default_factory=dict)


def derive_token_key(key: bytes) -> bytes:
    # Separate the tokenisation key from the project key so the same project key can serve
    # other purposes without its outputs being comparable.
    return hmac.digest(key, TOKEN_KEY_LABEL, "sha256")


def key_id(key: bytes) -> str:
    """A short public identifier of a key (safe to log/audit; reveals nothing about the key)."""
    return hmac.digest(key, KEY_ID_LABEL, "sha256")[:8].hex()


def as_string(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous string array (tokenising needs a single dictionary)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_large_string(arr.type) or not pa.types.is_string(arr.type):
        arr = pc.cast(arr, pa.string())
    return arr


_B32 = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz234567", dtype=np.uint8)
_B32_WEIGHTS = np.array([16, 8, 4, 2, 1], dtype=np.uint8)


def _b32_prefix(macs: bytes, n: int, length: int) -> pa.Array:
    """First ``length`` lower-case RFC 4648 base32 characters of each 32-byte MAC, vectorised
    (identical to ``base64.b32encode(mac).lower()[:length]``, which is pure Python and slow)."""
    bits = np.unpackbits(np.frombuffer(macs, dtype=np.uint8).reshape(n, 32), axis=1)[:, : 5 * length]
    chars = _B32[(bits.reshape(n, length, 5) * _B32_WEIGHTS).sum(axis=2)]
    return pa.Array.from_buffers(pa.binary(length), n, [None, pa.py_buffer(chars.tobytes())]).cast(pa.string())


def tokens_for(values: list[str | None], token_key: bytes, *, domain: str, prefix: str, length: int) -> pa.Array:
    """Tokens for a list of values (nulls stay null)."""
    dom = domain.encode("utf-8") + b"\x00"
    digest = hmac.digest
    macs = b"".join(
        digest(token_key, dom + (v.encode("utf-8") if v is not None else b""), "sha256") for v in values
    )
    toks = _b32_prefix(macs, len(values), length)
    if prefix:
        toks = pc.binary_join_element_wise(pa.scalar(prefix), toks, "")
    nulls = pa.array([v is None for v in values], pa.bool_())
    return pc.if_else(nulls, pa.scalar(None, pa.string()), toks)


def tokenize(arr: pa.Array, token_key: bytes, *, domain: str, prefix: str, length: int, stats: ColumnStats | None = None) -> pa.Array:
    """Deterministic pseudonyms: prefix + base32(HMAC-SHA256(k_tok, domain || 0x00 || value))[:length]."""
    arr = as_string(arr)
    enc = pc.dictionary_encode(arr)
    dictionary = enc.dictionary.to_pylist()
    if stats is not None:
        stats.distinct = len(dictionary)
    toks = tokens_for(dictionary, token_key, domain=domain, prefix=prefix, length=length)
    return pc.take(toks, enc.indices)


def normalize(arr: pa.Array, how: str) -> pa.Array:
    if how in ("strip", "strip_lower"):
        arr = pc.utf8_trim_whitespace(arr)
    if how in ("lower", "strip_lower"):
        arr = pc.utf8_lower(arr)
    return arr


def redact(arr: pa.Array | pa.ChunkedArray, replacement: str) -> pa.Array:
    """Constant replacement; nulls stay null (absence is not the value)."""
    arr = as_string(arr)
    return pc.if_else(pc.is_null(arr), pa.scalar(None, pa.string()), pa.scalar(replacement, pa.string()))


def luhn_valid(digits: pa.Array) -> np.ndarray:
    """Vectorised Luhn check of digit-only strings of length <= 19 (nulls -> False)."""
    n = len(digits)
    if n == 0:
        return np.zeros(0, dtype=bool)
    filled = pc.fill_null(digits, "0")
    padded = pc.utf8_lpad(filled, width=19, padding="0").cast(pa.binary(19))
    raw = np.frombuffer(padded.buffers()[1], dtype=np.uint8, count=(padded.offset + n) * 19)
    d = raw[padded.offset * 19:].reshape(n, 19).astype(np.int16) - ord("0")
    # Position k from the right (k=0 is the check digit); every odd k is doubled.
    doubled = d[:, -2::-2] * 2
    total = d[:, ::-2].sum(axis=1) + (doubled - 9 * (doubled > 9)).sum(axis=1)
    ok = (total % 10) == 0
    return ok & ~np.asarray(pc.is_null(digits).to_numpy(zero_copy_only=False))


def _bool_np(arr: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, False).to_numpy(zero_copy_only=False), dtype=bool)


def pan(arr: pa.Array, token_key: bytes, *, mode: str, validate_luhn: bool, prefix: str, length: int,
        domain: str, stats: ColumnStats) -> tuple[pa.Array, int]:
    """Card numbers: keep last 4 (PCI DSS allows it), tokenise, or both. Returns (out, n_invalid)."""
    s = as_string(arr)
    digits = pc.replace_substring_regex(pc.utf8_trim_whitespace(s), r"[ \-]", "")
    shape_ok = _bool_np(pc.match_substring_regex(digits, r"^\d{12,19}$"))
    valid = shape_ok & (luhn_valid(pc.if_else(pa.array(shape_ok), digits, pa.scalar(None, pa.string())))
                        if validate_luhn else shape_ok)
    present = ~_bool_np(pc.is_null(s))
    invalid = int((present & ~valid).sum())
    last4 = pc.utf8_slice_codeunits(digits, -4)
    if mode == "last4":
        out = pc.binary_join_element_wise("************", last4, "")
    else:
        tok = tokenize(digits, token_key, domain=domain, prefix=prefix, length=length, stats=stats)
        out = tok if mode == "tokenize" else pc.binary_join_element_wise(tok, last4, "_")
    out = pc.if_else(pa.array(valid), out, pa.scalar(INVALID_PAN))
    return pc.if_else(pc.is_null(s), pa.scalar(None, pa.string()), out), invalid


def email(arr: pa.Array, token_key: bytes, *, keep_domain: bool, prefix: str, length: int, domain: str,
          stats: ColumnStats) -> tuple[pa.Array, int]:
    """tok@domain: the token is the HMAC of the whole lower-cased address (so john@a and john@b differ)."""
    s = pc.utf8_lower(pc.utf8_trim_whitespace(as_string(arr)))
    parts = pc.extract_regex(s, r"^(?P<local>[^@\s]+)@(?P<domain>[^@\s]+\.[^@\s]+)$")
    valid = _bool_np(pc.is_valid(parts))
    present = ~_bool_np(pc.is_null(s))
    tok = tokenize(s, token_key, domain=domain, prefix=prefix, length=length, stats=stats)
    if keep_domain:
        tok = pc.binary_join_element_wise(tok, pc.struct_field(parts, "domain"), "@")
    out = pc.if_else(pa.array(valid), tok, pa.scalar(INVALID_EMAIL))
    return pc.if_else(pc.is_null(s), pa.scalar(None, pa.string()), out), int((present & ~valid).sum())


def phone(arr: pa.Array, token_key: bytes, *, keep_last: int, prefix: str, length: int, domain: str,
          stats: ColumnStats) -> tuple[pa.Array, int]:
    """Tokenise the digits (formatting-insensitive); optionally append the last N digits."""
    s = as_string(arr)
    digits = pc.replace_substring_regex(s, r"[^0-9]", "")
    nd = pc.utf8_length(digits)
    valid = _bool_np(pc.and_(pc.greater_equal(nd, 7), pc.less_equal(nd, 15)))
    present = ~_bool_np(pc.is_null(s))
    out = tokenize(digits, token_key, domain=domain, prefix=prefix, length=length, stats=stats)
    if keep_last:
        out = pc.binary_join_element_wise(out, pc.utf8_slice_codeunits(digits, -keep_last), "~")
    out = pc.if_else(pa.array(valid), out, pa.scalar(INVALID_PHONE))
    return pc.if_else(pc.is_null(s), pa.scalar(None, pa.string()), out), int((present & ~valid).sum())


def generalize_date(arr: pa.Array | pa.ChunkedArray, *, granularity: str, date_format: str) -> pa.Array:
    """Dates/timestamps -> 'YYYY-MM' or 'YYYY'. Strings are parsed with ``date_format`` (strict)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        arr = pc.strptime(pc.utf8_trim_whitespace(arr), format=date_format, unit="s", error_is_null=False)
    elif not (pa.types.is_date(arr.type) or pa.types.is_timestamp(arr.type)):
        raise TypeError(f"expected a date, timestamp or string column, got {arr.type}")
    if pa.types.is_timestamp(arr.type) and arr.type.tz is not None:
        arr = arr.cast(pa.timestamp(arr.type.unit))  # calendar month of the stored UTC instant
    return pc.strftime(arr, format="%Y-%m" if granularity == "month" else "%Y")


def _edge_label(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def bin_labels(edges: list[float]) -> list[str]:
    labels = [f"(-inf,{_edge_label(edges[0])})"]
    labels += [f"[{_edge_label(a)},{_edge_label(b)})" for a, b in zip(edges, edges[1:])]
    labels.append(f"[{_edge_label(edges[-1])},inf)")
    return labels


def generalize_bins(arr: pa.Array | pa.ChunkedArray, edges: list[float]) -> pa.Array:
    """Numbers -> half-open interval labels '[a,b)'; below the first edge '(-inf,a)', above '[z,inf)'."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        arr = pc.cast(pc.utf8_trim_whitespace(arr), pa.float64())  # strict: non-numbers raise
    elif not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type)):
        raise TypeError(f"expected a numeric column, got {arr.type}")
    values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
    missing = np.isnan(values)
    idx = np.searchsorted(np.asarray(edges, dtype=np.float64), np.where(missing, 0.0, values), side="right")
    return pc.take(pa.array(bin_labels(edges), pa.string()), pa.array(idx.astype(np.int32), mask=missing))


def scannable(arr: pa.Array | pa.ChunkedArray) -> pa.Array | None:
    """The string view of a column the detectors can scan, or None (floats, dates, bools...)."""
    t = arr.type.value_type if pa.types.is_dictionary(arr.type) else arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t):
        return as_string(arr)
    return None


def detect(s: pa.Array, detectors: list[str], *, integer: bool) -> dict[str, np.ndarray]:
    """Per detector, a boolean mask of cells with a PII-shaped value.

    PAN hits must also pass Luhn (on the first match in the cell), which keeps order numbers and
    other long digit runs from tripping it. Integer columns are only checked for whole-value PANs.
    """
    hits: dict[str, np.ndarray] = {}
    for name in detectors:
        if integer:
            if name != "pan":
                continue
            shaped = _bool_np(pc.match_substring_regex(s, r"^\d{13,19}$"))
            hits[name] = shaped & luhn_valid(pc.if_else(pa.array(shaped), s, pa.scalar(None, pa.string())))
            continue
        shaped = _bool_np(pc.match_substring_regex(s, DETECTOR_PATTERNS[name]))
        if name == "pan" and shaped.any():
            first = pc.struct_field(pc.extract_regex(s, f"(?P<m>{DETECTOR_PATTERNS['pan']})"), "m")
            digits = pc.replace_substring_regex(first, r"[ \-]", "")
            digits = pc.if_else(pa.array(shaped), digits, pa.scalar(None, pa.string()))
            shaped &= luhn_valid(digits)
        hits[name] = shaped
    return hits


def redact_matches(s: pa.Array, detectors: list[str], *, integer: bool) -> pa.Array:
    """Replace every PII-shaped substring with [EMAIL]/[IBAN]/[PAN]/[SSN]/[PHONE]."""
    if integer:
        mask = detect(s, ["pan"], integer=True).get("pan", np.zeros(len(s), bool))
        return pc.if_else(pa.array(mask), pa.scalar("[PAN]"), s)
    for name in DETECTOR_PATTERNS:  # fixed order: specific shapes before generic digit runs
        if name in detectors:
            s = pc.replace_substring_regex(s, DETECTOR_PATTERNS[name], f"[{name.upper()}]")
    return s


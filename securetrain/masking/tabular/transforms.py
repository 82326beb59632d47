"""Vectorised column transforms (pyarrow.compute), one function per policy action.

Everything here works on whole arrays. The only per-value Python work is the HMAC, and that runs
once per *distinct* value (dictionary-encode, tokenise the dictionary, take), so a column with few
distinct values costs almost nothing and a unique-per-row column costs one HMAC per row.

Invalid values (a PAN that fails Luhn, an e-mail without '@') are never passed through: they are
replaced by a fixed marker such as ``[INVALID_PAN]`` or the rule asks for an error.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securetrain.masking.tabular.arrow_buffers import is_ascii, offsets_and_data
from securetrain.masking.tabular.hmac_batch import HmacSha256
from securetrain.masking.tabular.hmac_native import native_macs
from securetrain.masking.tabular.hmac_pool import hmac_many

TOKEN_KEY_LABEL = b"securetrain.tabular.tokenize.v1"
KEY_ID_LABEL = b"securetrain.tabular.key-id.v1"

INVALID_PAN = "[INVALID_PAN]"
INVALID_EMAIL = "[INVALID_EMAIL]"
INVALID_PHONE = "[INVALID_PHONE]"

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
# Two base32 characters per 10-bit value, as one little-endian uint16 (first character low).
_B32_PAIRS = (_B32[np.arange(1024) >> 5].astype(np.uint16) | (_B32[np.arange(1024) & 31].astype(np.uint16) << 8))
_MAC_BYTES = 32


def _b32_prefix(macs: bytes, n: int, length: int, prefix: bytes = b"") -> pa.Array:
    """``prefix`` + the first ``length`` lower-case RFC 4648 base32 characters of each 32-byte MAC,
    vectorised (identical to ``prefix + base64.b32encode(mac).lower()[:length]``, which is pure
    Python and slow).

    Base32 maps each 5-byte group to 8 characters; each group is cut into four 10-bit values
    with a few uint16 operations, and a 1024-entry table gives the two characters of each (so
    the work is on small integers, not one 64-bit value per character). Past the 32 MAC bytes
    the input is zero-padded, which only the unused tail of a 52nd character would touch. The
    prefix is written into the same fixed-width buffer, so no string concatenation pass follows."""
    if n == 0:
        return pa.array([], pa.string())
    groups = -(-length // 8)
    mac = np.frombuffer(macs, dtype=np.uint8).reshape(n, _MAC_BYTES)
    if 5 * groups > _MAC_BYTES:
        mac = np.concatenate((mac, np.zeros((n, 5 * groups - _MAC_BYTES), dtype=np.uint8)), axis=1)
    g = mac[:, :5 * groups].reshape(n, groups, 5).astype(np.uint16)
    ten = np.empty((n, groups, 4), dtype=np.uint16)
    ten[..., 0] = (g[..., 0] << 2) | (g[..., 1] >> 6)
    ten[..., 1] = ((g[..., 1] & 0x3F) << 4) | (g[..., 2] >> 4)
    ten[..., 2] = ((g[..., 2] & 0x0F) << 6) | (g[..., 3] >> 2)
    ten[..., 3] = ((g[..., 3] & 0x03) << 8) | g[..., 4]
    b32 = _B32_PAIRS.take(ten).reshape(n, 4 * groups).view(np.uint8)  # (n, 8 * groups) characters; take: 2x [] here
    width = len(prefix) + length
    chars = np.empty((n, width), dtype=np.uint8)
    chars[:, :len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    chars[:, len(prefix):] = b32[:, :length]
    # A string array straight over the fixed-width buffer (offsets i * width): no cast pass.
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(chars)])


def _finish_tokens(macs: bytes, n: int, *, prefix: str, length: int) -> pa.Array:
    return _b32_prefix(macs, n, length, prefix.encode("utf-8"))


def tokens_for(values: list[str | None], token_key: bytes, *, domain: str, prefix: str, length: int) -> pa.Array:
    """Tokens for a list of values (nulls stay null)."""
    dom = domain.encode("utf-8") + b"\x00"
    macs = HmacSha256(token_key).many(dom + (v.encode("utf-8") if v is not None else b"") for v in values)
    toks = _finish_tokens(macs, len(values), prefix=prefix, length=length)
    nulls = pa.array([v is None for v in values], pa.bool_())
    return pc.if_else(nulls, pa.scalar(None, pa.string()), toks)


def _macs(values: pa.Array, token_key: bytes, domain: str) -> bytes:
    """Concatenated 32-byte HMAC-SHA256(k_tok, utf8(domain) || 0x00 || utf8(value)) of each value
    of a string array without nulls.

    Values reach the MAC as ``bytes`` straight from pyarrow, so no Python string is created per
    value. A large column's MACs are computed natively in one pass (hmac_native, DataFusion).
    Without it: the domain separator is absorbed into the HMAC's inner state once per column, so
    each value is hashed straight from pyarrow's bytes objects (no per-value concatenation), and a
    large column is shared with helper processes (hmac_pool). The MACs are identical either way."""
    if values.null_count:
        raise ValueError("tokens_for_array needs an array without nulls")
    dom = domain.encode("utf-8") + b"\x00"
    macs = native_macs(values, token_key, dom)
    return hmac_many(values, token_key, dom) if macs is None else macs


def distinct_macs(macs: bytes) -> int:
    """How many distinct values the concatenated 32-byte MACs ``macs`` came from.

    Distinct values have distinct MACs (HMAC-SHA256), so counting the MACs' leading 8 bytes
    (one sort of 64-bit integers) counts the values without hashing them again: several times
    cheaper than ``pc.unique`` of the strings. Two distinct values share a 64-bit prefix with
    probability about n^2 / 2^65 (5e-9 for a million values), which would undercount by one;
    the count is a report statistic, never used for masking."""
    if not macs:
        return 0
    heads = np.frombuffer(macs, dtype=np.uint64)[::_MAC_BYTES // 8].copy()
    heads.sort()
    return int(np.count_nonzero(heads[1:] != heads[:-1])) + 1


def tokens_for_array(values: pa.Array, token_key: bytes, *, domain: str, prefix: str, length: int) -> pa.Array:
    """Tokens for a string array without nulls (e.g. a dictionary), one HMAC per element.

    The MAC input is ``utf8(domain) || 0x00 || utf8(value)`` (see :func:`_macs`)."""
    return _finish_tokens(_macs(values, token_key, domain), len(values), prefix=prefix, length=length)


def tokenize(arr: pa.Array, token_key: bytes, *, domain: str, prefix: str, length: int, stats: ColumnStats | None = None) -> pa.Array:
    """Deterministic pseudonyms: prefix + base32(HMAC-SHA256(k_tok, domain || 0x00 || value))[:length]."""
    arr = as_string(arr)
    if _probably_unique(arr):  # a MAC per row, no dictionary or take (duplicates get the same token)
        return _tokens_of_distinct(arr, token_key, domain=domain, prefix=prefix, length=length, stats=stats,
                                   values_distinct=False)
    # Nulls become null indices (not dictionary entries), so take() keeps them null.
    enc = pc.dictionary_encode(arr)
    return pc.take(_tokens_of_distinct(enc.dictionary, token_key, domain=domain, prefix=prefix, length=length,
                                       stats=stats), enc.indices)


# A column without nulls whose leading values are (almost) all distinct is transformed row by row
# (each duplicate computed again, with the same result) instead of through a dictionary: the
# dictionary encode and the ``take`` back to rows go away, and the distinct count for the report
# comes from the MACs (:func:`distinct_macs`). Judged on the leading values only: a column that
# repeats (customers with several transactions each) says so there.
NEARLY_UNIQUE = 0.9
UNIQUE_PROBE = 8192


def _probably_unique(arr: pa.Array) -> bool:
    """Whether ``arr`` has no nulls, at least 4 x UNIQUE_PROBE values and leading values as
    distinct as those of a column with NEARLY_UNIQUE of its values distinct."""
    n = len(arr)
    if arr.null_count or n < 4 * UNIQUE_PROBE:
        return False
    # Leading values drawn from a column with NEARLY_UNIQUE * n distinct values are themselves
    # distinct but for about probe / (2 * distinct) of them (birthday bound), so a probe below
    # that (customers with several transactions each) says "repeats" before a full pass is paid.
    return len(pc.unique(arr.slice(0, UNIQUE_PROBE))) >= UNIQUE_PROBE * (
        1 - UNIQUE_PROBE / (2 * NEARLY_UNIQUE * n) - 0.005)


def _tokens_of_distinct(values: pa.Array, token_key: bytes, *, domain: str, prefix: str, length: int,
                        stats: ColumnStats | None, values_distinct: bool = True) -> pa.Array:
    """Tokens of ``values``, one HMAC each. ``values_distinct``: they are already distinct (a
    dictionary), so their number is the distinct count; else it is counted from the MACs."""
    macs = _macs(values, token_key, domain)
    if stats is not None:
        stats.distinct = len(values) if values_distinct else distinct_macs(macs)
    return _finish_tokens(macs, len(values), prefix=prefix, length=length)


def keep_bytes(arr: pa.Array, keep: np.ndarray) -> pa.Array:
    """``arr`` with only the bytes whose value is marked in the 256-entry table ``keep``.

    Used with ASCII-only tables (digits; everything but ' ' and '-'), so multi-byte UTF-8
    sequences are kept or dropped whole. Vectorised replacement for
    ``replace_substring_regex(arr, "[^0-9]", "")`` and the like (an order of magnitude faster).
    Nulls stay null.
    """
    arr = as_string(arr)
    offsets, data = offsets_and_data(arr)
    mask = keep[data]
    if mask.all():  # nothing to drop (card numbers stored as plain digits): no copy
        return arr
    cum = np.zeros(len(data) + 1, dtype=np.int32)  # string data is < 2 GiB: int32 offsets suffice
    np.cumsum(mask, out=cum[1:])
    new_offsets = cum[offsets]
    out = pa.Array.from_buffers(pa.string(), len(arr),
                                [None, pa.py_buffer(new_offsets), pa.py_buffer(data[mask].tobytes())])
    if arr.null_count:
        out = pc.if_else(pc.is_null(arr), pa.scalar(None, pa.string()), out)
    return out


def byte_table(chars: bytes, *, invert: bool = False) -> np.ndarray:
    table = np.zeros(256, dtype=bool)
    table[np.frombuffer(chars, dtype=np.uint8)] = True
    return ~table if invert else table


DIGITS = byte_table(b"0123456789")
NOT_SPACE_OR_DASH = byte_table(b" -", invert=True)


def lower(arr: pa.Array | pa.ChunkedArray, *, ascii: bool | None = None) -> pa.Array:
    """``utf8_lower``, but through the ~30x faster ``ascii_lower`` when every byte of the column is
    ASCII (then the two are identical; one numpy max over the buffer decides, unless the caller
    already knows: ``ascii``)."""
    arr = as_string(arr)
    if ascii is None:
        ascii = is_ascii(offsets_and_data(arr)[1])
    if ascii:
        return pc.ascii_lower(arr)
    return pc.utf8_lower(arr)


def normalize(arr: pa.Array, how: str) -> pa.Array:
    if how in ("strip", "strip_lower"):
        arr = pc.utf8_trim_whitespace(arr)
    if how in ("lower", "strip_lower"):
        arr = lower(arr)
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
    width = _common_width(digits)
    if width is not None:  # all the same length (16-digit cards): the bytes as an (n, width) view
        d = offsets_and_data(digits)[1].reshape(n, width).astype(np.int16) - ord("0")
    else:
        filled = pc.fill_null(digits, "0")
        padded = pc.utf8_lpad(filled, width=19, padding="0").cast(pa.binary(19))
        raw = np.frombuffer(padded.buffers()[1], dtype=np.uint8, count=(padded.offset + n) * 19)
        d = raw[padded.offset * 19:].reshape(n, 19).astype(np.int16) - ord("0")
    # Position k from the right (k=0 is the check digit); every odd k is doubled.
    doubled = d[:, -2::-2] * 2
    total = d[:, ::-2].sum(axis=1) + (doubled - 9 * (doubled > 9)).sum(axis=1)
    ok = (total % 10) == 0
    return ok & ~np.asarray(pc.is_null(digits).to_numpy(zero_copy_only=False)) if digits.null_count else ok


def _common_width(arr: pa.Array) -> int | None:
    """The byte length shared by every value of a string array without nulls (1-19), else None.
    Leading zeros do not change a Luhn sum, so such values need no left-padding to 19."""
    if arr.null_count or arr.type != pa.string():
        return None
    lengths = np.diff(offsets_and_data(arr)[0])
    width = int(lengths[0])
    return width if 0 < width <= 19 and bool((lengths == width).all()) else None


def _last4_masked(digits: pa.Array) -> pa.Array:
    """``"************" + value[-4:]`` for values of at least 4 ASCII bytes (others: garbage, to be
    replaced by the caller), built in one fixed-width buffer instead of a slice and a join pass."""
    n = len(digits)
    offsets, data = offsets_and_data(digits)
    if n == 0 or data.size == 0:
        return pc.binary_join_element_wise("************", pc.utf8_slice_codeunits(digits, -4), "")
    chars = np.full((n, 16), ord("*"), dtype=np.uint8)
    chars[:, 12:] = data[np.clip(offsets[1:, None] - 4 + np.arange(4), 0, data.size - 1)]
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(np.arange(0, 16 * (n + 1), 16, dtype=np.int32)),
                                                  pa.py_buffer(chars)])


def _bool_np(arr: pa.Array) -> np.ndarray:
    return np.asarray(pc.fill_null(arr, False).to_numpy(zero_copy_only=False), dtype=bool)


def _per_distinct(norm: pa.Array, fn: Callable[[pa.Array, bool], tuple[pa.Array, np.ndarray]],
                  stats: ColumnStats) -> tuple[pa.Array, int]:
    """Run a per-value transform ``fn(values, distinct)`` (-> output, valid mask) once per distinct
    value of the row-wise normalised column ``norm`` and map the result back to rows; return
    (output, number of non-null rows that were invalid). ``distinct`` tells ``fn`` whether its
    values are distinct (a dictionary) or the rows themselves (for its distinct count).

    The normalisation (trim, lower-case, digit filter) is a cheap vectorised pass over the rows;
    everything after it (validity, HMAC, formatting) is a function of the normalised value, so
    one dictionary encode serves the validity passes and the tokens alike (identifier columns
    repeat: a customer's card, e-mail and phone on every transaction). A column whose values are
    (almost) all distinct skips the dictionary (:func:`_probably_unique`). Nulls stay null."""
    if _probably_unique(norm):
        out, valid = fn(norm, False)
        return out, int((~valid).sum())
    enc = pc.dictionary_encode(norm)
    out_d, valid_d = fn(enc.dictionary, True)
    indices = enc.indices
    rows = pc.drop_null(indices).to_numpy(zero_copy_only=False)
    invalid = int(np.bincount(rows, minlength=len(valid_d))[~valid_d].sum()) if len(valid_d) else 0
    return pc.take(out_d, indices), invalid


def pan(arr: pa.Array, token_key: bytes, *, mode: str, validate_luhn: bool, prefix: str, length: int,
        domain: str, stats: ColumnStats) -> tuple[pa.Array, int]:
    """Card numbers: keep last 4 (PCI DSS allows it), tokenise, or both. Returns (out, n_invalid)."""

    def on_values(digits: pa.Array, distinct: bool) -> tuple[pa.Array, np.ndarray]:
        # ^\d{12,19}$ (RE2: ASCII digits), without a regex pass: ASCII decimal and 12-19 bytes long.
        size = pc.binary_length(digits)
        shape_ok = _bool_np(pc.and_(pc.ascii_is_decimal(digits),
                                    pc.and_(pc.greater_equal(size, 12), pc.less_equal(size, 19))))
        valid = shape_ok & (luhn_valid(pc.if_else(pa.array(shape_ok), digits, pa.scalar(None, pa.string())))
                            if validate_luhn else shape_ok)
        if mode == "last4":
            out = _last4_masked(digits)  # valid values are 12-19 ASCII digits: bytes are code units
        else:
            tok = _tokens_of_distinct(digits, token_key, domain=domain, prefix=prefix, length=length, stats=stats,
                                      values_distinct=distinct)
            out = tok if mode == "tokenize" else pc.binary_join_element_wise(
                tok, pc.utf8_slice_codeunits(digits, -4), "_")
        return pc.if_else(pa.array(valid), out, pa.scalar(INVALID_PAN)), valid

    return _per_distinct(keep_bytes(pc.utf8_trim_whitespace(as_string(arr)), NOT_SPACE_OR_DASH), on_values, stats)


def email(arr: pa.Array, token_key: bytes, *, keep_domain: bool, prefix: str, length: int, domain: str,
          stats: ColumnStats) -> tuple[pa.Array, int]:
    """tok@domain: the token is the HMAC of the whole lower-cased address (so john@a and john@b differ)."""

    def on_values(s: pa.Array, distinct: bool) -> tuple[pa.Array, np.ndarray]:
        # Valid = ^[^@\s]+@[^@\s]+\.[^@\s]+$ (RE2 \s). A capture-free match runs as a DFA; the
        # domain is then the second '@'-separated part, which is exact for valid values.
        valid = _bool_np(pc.match_substring_regex(s, EMAIL_SHAPE))
        tok = _tokens_of_distinct(s, token_key, domain=domain, prefix=prefix, length=length, stats=stats,
                                  values_distinct=distinct)
        if keep_domain:
            tok = pc.binary_join_element_wise(tok, _after_first_at(s, valid), "@")
        return pc.if_else(pa.array(valid), tok, pa.scalar(INVALID_EMAIL)), valid

    return _per_distinct(lower(pc.utf8_trim_whitespace(as_string(arr))), on_values, stats)


EMAIL_SHAPE = r"^[^@\s]+@[^@\s]+\.[^@\s]+$"


def _after_first_at(s: pa.Array, valid: np.ndarray) -> pa.Array:
    """The text after the first '@' where ``valid`` (null elsewhere).

    The text buffer is cut, without copying, into two pieces per value (up to and including the
    first '@', the rest) and ``take`` gathers the second pieces: no split into a list array."""
    n = len(s)
    at = pc.fill_null(pc.find_substring(s, "@"), -1).to_numpy(zero_copy_only=False).astype(np.int64)  # bytes
    ok = valid & (at >= 0)
    offsets, data = offsets_and_data(s)
    if not ok.any() or len(data) >= 2**31:
        return pa.nulls(n, pa.string()) if not ok.any() else _after_first_at_split(s, ok)
    bounds = np.empty(2 * n + 1, dtype=np.int32)
    bounds[0:-1:2] = offsets[:-1]
    bounds[1::2] = np.where(ok, offsets[:-1] + at + 1, offsets[:-1])
    bounds[-1] = offsets[-1]
    pieces = pa.Array.from_buffers(pa.string(), 2 * n, [None, pa.py_buffer(bounds), pa.py_buffer(data)])
    return pc.take(pieces, pa.array(2 * np.arange(n) + 1, mask=~ok))


def _after_first_at_split(s: pa.Array, ok: np.ndarray) -> pa.Array:
    """:func:`_after_first_at` for text buffers too large for 32-bit offsets."""
    parts = pc.split_pattern(s, "@", max_splits=1)
    starts = parts.offsets.to_numpy()[:-1].astype(np.int64)  # absolute positions in parts.values
    return pc.take(parts.values, pa.array(np.where(ok, starts + 1, 0), mask=~ok))


def phone(arr: pa.Array, token_key: bytes, *, keep_last: int, prefix: str, length: int, domain: str,
          stats: ColumnStats) -> tuple[pa.Array, int]:
    """Tokenise the digits (formatting-insensitive); optionally append the last N digits."""

    def on_values(digits: pa.Array, distinct: bool) -> tuple[pa.Array, np.ndarray]:
        nd = pc.binary_length(digits)  # ASCII digits only: bytes are characters
        valid = _bool_np(pc.and_(pc.greater_equal(nd, 7), pc.less_equal(nd, 15)))
        out = _tokens_of_distinct(digits, token_key, domain=domain, prefix=prefix, length=length, stats=stats,
                                  values_distinct=distinct)
        if keep_last:
            out = pc.binary_join_element_wise(out, pc.utf8_slice_codeunits(digits, -keep_last), "~")
        return pc.if_else(pa.array(valid), out, pa.scalar(INVALID_PHONE)), valid

    return _per_distinct(keep_bytes(as_string(arr), DIGITS), on_values, stats)


class UnparsableValuesError(ValueError):
    """Cells that hold a value the rule cannot parse; the message has counts and the expected
    format only, never a value."""


def _blank_to_null(arr: pa.Array) -> pa.Array:
    """Trimmed text with empty cells as nulls: an empty CSV cell of a text column is missing, as it
    is in a date or numeric column that pyarrow parsed itself."""
    trimmed = pc.utf8_trim_whitespace(arr)
    return pc.if_else(pc.equal(trimmed, ""), pa.scalar(None, trimmed.type), trimmed)


def generalize_date(arr: pa.Array | pa.ChunkedArray, *, granularity: str, date_format: str) -> pa.Array:
    """Dates/timestamps -> 'YYYY-MM' or 'YYYY'. Strings are parsed with ``date_format`` (strict;
    empty cells are missing)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        text = _blank_to_null(arr)
        arr = pc.strptime(text, format=date_format, unit="s", error_is_null=True)
        bad = arr.null_count - text.null_count
        if bad:
            raise UnparsableValuesError(f"{bad} value(s) do not match date_format {date_format!r}")
    elif not (pa.types.is_date(arr.type) or pa.types.is_timestamp(arr.type)):
        raise TypeError(f"expected a date, timestamp or string column, got {arr.type}")
    if pa.types.is_timestamp(arr.type) and arr.type.tz is not None:
        arr = arr.cast(pa.timestamp(arr.type.unit))  # calendar month of the stored UTC instant
    # Format each distinct month/year once: floor to the period, dictionary-encode, format, take.
    # strftime per row is the slow part (~0.5 us a value) and there are only a few hundred periods.
    enc = pc.dictionary_encode(pc.floor_temporal(arr, 1, granularity))
    labels = pc.strftime(enc.dictionary, format="%Y-%m" if granularity == "month" else "%Y")
    return pc.take(labels, enc.indices)


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
        try:
            arr = pc.cast(_blank_to_null(arr), pa.float64())  # strict: non-numbers raise
        except pa.ArrowInvalid:
            raise UnparsableValuesError("some values are not numbers (bins need numbers)") from None
    elif not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type)):
        raise TypeError(f"expected a numeric column, got {arr.type}")
    values = pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)
    missing = np.isnan(values)
    idx = np.searchsorted(np.asarray(edges, dtype=np.float64), np.where(missing, 0.0, values), side="right")
    return pc.take(pa.array(bin_labels(edges), pa.string()), pa.array(idx.astype(np.int32), mask=missing))


def _is_other_text(t: pa.DataType) -> bool:
    """Text in another Arrow type: string_view, or binary (Hive/Impala write strings as BINARY)."""
    return (pa.types.is_string_view(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t))


def scannable(arr: pa.Array | pa.ChunkedArray) -> pa.Array | None:
    """The string view of a column the detectors can scan, or None (floats, dates, bools..., and
    binary that is not UTF-8 text or nested types: see :func:`holds_no_text`)."""
    t = arr.type.value_type if pa.types.is_dictionary(arr.type) else arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t):
        return as_string(arr)
    if _is_other_text(t):
        try:
            return as_string(arr)
        except pa.ArrowInvalid:  # not UTF-8: the detectors cannot read it
            return None
    return None


def holds_no_text(t: pa.DataType) -> bool:
    """Types that cannot carry text (numbers, booleans, dates and times, nulls): safe to keep
    unscanned. Anything else the detectors cannot read (lists, structs, maps, non-UTF-8 binary)
    may hide PII and is refused when kept with scanning on."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    return (pa.types.is_null(t) or pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t)
            or pa.types.is_decimal(t) or pa.types.is_temporal(t))

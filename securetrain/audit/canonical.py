"""The exact bytes that are hashed for each audit entry, and the rules events must follow.

An entry is hashed as the RFC 8785 (JCS) canonical JSON of :func:`entry_object` — every field
except ``entry_hash``. ``entry_hash = SHA-256(those bytes)``; the Merkle leaf is
``SHA-256(0x00 || those bytes)``. ``docs/audit-format.md`` is the normative description.

No JSON number with a fraction is ever hashed: JCS float formatting is the one part of RFC 8785
that is hard to re-implement exactly, and auditors must be able to verify with a 200-line script.
A finite Python float in ``details`` is therefore stored as the string ``repr(value)`` (the
shortest decimal that round-trips, e.g. ``0.25`` -> ``"0.25"``); NaN and infinities are refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import rfc8785

from securetrain.audit.errors import AuditEventError

FORMAT_VERSION = 1
GENESIS_HASH = "0" * 64

#: Fields of the hashed object, in the order the documentation lists them (JCS sorts them anyway).
HASHED_FIELDS = ("v", "seq", "ts", "actor", "hostname", "mac", "action", "resource", "outcome", "details", "prev_hash")
#: Optional member of the hashed object: the database server's view of the writer (PostgreSQL only;
#: absent on SQLite and in entries written before it existed, so those hash exactly as before).
SERVER_VIEW = "server_view"
#: Members of ``server_view``: ``role`` (current_user), ``addr`` (inet_client_addr(), null for a
#: Unix-socket connection), ``time`` (clock_timestamp(), UTC, same format as ``ts``).
SERVER_VIEW_FIELDS = ("addr", "role", "time")

MAX_DETAILS_BYTES = 16 * 1024
MAX_DEPTH = 8
MAX_SAFE_INT = 2**53 - 1  # I-JSON (RFC 7493) range; RFC 8785 requires it
MAX_TEXT = 1024

_ACTION_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")
_OUTCOME_RE = re.compile(r"^[a-z_]{1,32}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# Lone UTF-16 surrogates (U+D800..U+DFFF) have no UTF-8 encoding, so no canonical JSON form.
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# Key names that almost always hold a secret; "<word>_id", "<word>_sha256" etc. are fine.
_SECRET_WORDS = frozenset(
    {"password", "passwd", "passphrase", "pwd", "secret", "token", "apikey", "credential", "credentials",
     "privatekey", "cookie", "authorization", "otp", "pin", "ssn"}
)
_SAFE_SUFFIXES = frozenset(
    {"id", "ids", "sha256", "digest", "hash", "fingerprint", "count", "len", "length", "version", "type",
     "name", "alg", "algorithm", "kind", "source", "provider", "ref", "expiry", "expires", "rotated"}
)


#: (second, its formatted date and time) of the last timestamp: every append stamps its entries,
#: and formatting only the microseconds is a fifth of a ``strftime``.
_LAST_SECOND: tuple[int, str] = (-1, "")


def utc_timestamp(now: datetime | None = None) -> str:
    """RFC 3339 UTC with microseconds and ``Z``: ``2024-05-01T12:00:00.123456Z``."""
    global _LAST_SECOND
    if now is not None:
        return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    second, micros = divmod(time.time_ns() // 1000, 1_000_000)
    last = _LAST_SECOND  # one read: another thread may replace it meanwhile (a tuple, never torn)
    if last[0] != second:
        last = _LAST_SECOND = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{last[1]}.{micros:06d}Z"


def mac_address() -> str:
    """This host's MAC as ``aa:bb:cc:dd:ee:ff`` (``uuid.getnode()``; may be random if none is found)."""
    node = uuid.getnode()
    return ":".join(f"{(node >> shift) & 0xFF:02x}" for shift in range(40, -1, -8))


@functools.lru_cache(maxsize=4096)  # the same few key names, on every entry
def _is_secret_key(key: str) -> bool:
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)  # sessionToken -> session_Token
    tokens = [t for t in re.split(r"[^a-z0-9]+", snake.lower()) if t]
    if not tokens:
        return False
    if tokens[-1] in _SAFE_SUFFIXES:
        return False
    joined = "".join(tokens)
    return tokens[-1] == "key" or any(t in _SECRET_WORDS for t in tokens) or joined in _SECRET_WORDS


def _check_value(value: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise AuditEventError(f"audit details nested deeper than {MAX_DEPTH} at {path}")
    if value is None or isinstance(value, bool | str):
        if isinstance(value, str) and "PRIVATE KEY" in value and "-----BEGIN" in value:
            raise AuditEventError(f"audit details {path} looks like a private key", hint="record a key id, never key material")
        if isinstance(value, str) and _SURROGATE_RE.search(value):
            raise AuditEventError(f"audit details {path} contains a lone UTF-16 surrogate (not valid Unicode text)")
        return value
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INT:
            raise AuditEventError(f"audit details {path}: integer outside ±2^53-1", hint="record it as a string")
        return int(value)  # IntEnum etc. become plain ints
    if isinstance(value, float):
        # Stored as its shortest round-trip decimal string (Python repr), so the hashed JSON never
        # holds a JSON number with a fraction; non-finite values have no honest JSON form.
        if value != value or value in (float("inf"), float("-inf")):
            raise AuditEventError(f"audit details {path}: non-finite float {value!r}", hint="record a string such as 'nan'")
        return repr(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise AuditEventError(f"audit details {path}: keys must be strings, got {type(key).__name__}")
            if _SURROGATE_RE.search(key):
                raise AuditEventError(f"audit details {path}: a key contains a lone UTF-16 surrogate")
            if _is_secret_key(key):
                raise AuditEventError(
                    f"audit details key {path}.{key} looks like a secret",
                    hint="audit entries hold ids and digests only; record e.g. 'key_id' or 'token_sha256'",
                )
            out[key] = _check_value(item, f"{path}.{key}", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [_check_value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    raise AuditEventError(f"audit details {path}: {type(value).__name__} is not JSON", hint="use str/int/bool/None/list/dict")


def validate_details(details: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a plain-JSON copy of ``details`` or raise :class:`AuditEventError`."""
    return validated_details(details)[0]


def validated_details(details: Mapping[str, Any] | None) -> tuple[dict[str, Any], bytes]:
    """``validate_details`` and the canonical bytes of the result (the writer needs both)."""
    if details is None:
        return {}, b"{}"
    if not isinstance(details, Mapping):
        raise AuditEventError(f"audit details must be a mapping, got {type(details).__name__}")
    clean = _check_value(details, "details", 0)
    data = canonical_bytes_validated(clean)
    if len(data) > MAX_DETAILS_BYTES:
        raise AuditEventError(f"audit details are {len(data)} bytes, limit is {MAX_DETAILS_BYTES}",
                              hint="record digests, not data")
    return clean, data


def _check_text(name: str, value: Any, *, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or not value:
        raise AuditEventError(f"audit {name} must be a non-empty string")
    if len(value) > limit or _CONTROL_RE.search(value) or _SURROGATE_RE.search(value):
        raise AuditEventError(f"audit {name} is longer than {limit} characters or contains control characters "
                              "or lone surrogates")
    return value


def validate_event(action: str, resource: str, outcome: str) -> tuple[str, str, str]:
    if not isinstance(action, str) or not _ACTION_RE.match(action) or len(action) > 128:
        raise AuditEventError(f"audit action {action!r} must be dotted lowercase, e.g. 'checkpoint.write'")
    _check_text("resource", resource)
    if not isinstance(outcome, str) or not _OUTCOME_RE.match(outcome):
        raise AuditEventError(f"audit outcome {outcome!r} must be lowercase letters/underscores, e.g. 'success'")
    return action, resource, outcome


def entry_object(
    *, seq: int, ts: str, actor: str, hostname: str, mac: str, action: str, resource: str, outcome: str,
    details: Mapping[str, Any], prev_hash: str, server_view: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The object whose canonical JSON is hashed (all fields but ``entry_hash``).

    ``server_view`` is a member only when it is not None, so entries without it (SQLite, logs
    written before it existed) hash exactly as they always did.
    """
    obj = {
        "v": FORMAT_VERSION, "seq": seq, "ts": ts, "actor": actor, "hostname": hostname, "mac": mac,
        "action": action, "resource": resource, "outcome": outcome, "details": dict(details), "prev_hash": prev_hash,
    }
    if server_view is not None:
        obj[SERVER_VIEW] = dict(server_view)
    return obj


def canonical_bytes(obj: Mapping[str, Any]) -> bytes:
    """RFC 8785 canonical JSON (UTF-8).

    Raises :class:`AuditEventError` for values with no canonical form (integers outside ±(2^53-1),
    non-finite floats, lone surrogates), so callers - including the verifier, which meets such
    values only in tampered data - get one typed error instead of rfc8785's or the codec's.
    """
    try:
        return rfc8785.dumps(obj)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        raise AuditEventError(f"value has no RFC 8785 canonical form: {type(exc).__name__}") from None


# json's C encoder with these settings writes exactly the RFC 8785 form of JSON holding no floats and
# only integers within ±(2^53-1): the same escapes (\" \\ \b \f \n \r \t, other controls as
# lowercase \u00xx, everything else raw UTF-8) and keys sorted by code point, which equals JCS's
# UTF-16 order unless a key holds a character beyond U+FFFF. tests/audit/test_audit_canonical_fast.py
# compares the two on generated data.
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False,
                           check_circular=False).encode
_ASTRAL = re.compile("[\U00010000-\U0010ffff]").search


def canonical_bytes_validated(obj: Mapping[str, Any]) -> bytes:
    """:func:`canonical_bytes` for objects built from validated parts (``validate_details`` output,
    entry fields): no floats, integers within ±(2^53-1). About 10x faster (the C encoder); falls back
    to the RFC 8785 implementation when a character beyond U+FFFF could change the key order, and
    for anything the fast encoder cannot write (lone surrogates, non-JSON values)."""
    try:
        text = _ENCODE(obj)
        if text.isascii() or not _ASTRAL(text):
            return text.encode()
    except (TypeError, ValueError, UnicodeError):
        pass
    return canonical_bytes(obj)


#: json's own string escaping with ensure_ascii=False (the C function where available): the same
#: escapes as ``_ENCODE`` and as RFC 8785 (see above).
_ESCAPE = json.encoder.encode_basestring


def entry_bytes(
    *, seq: int, ts: str, actor: str, hostname: str, mac: str, action: str, resource: str, outcome: str,
    details_json: str, prev_hash: str, server_view_json: str | None = None,
) -> bytes:
    """``canonical_bytes_validated(entry_object(...))`` without building and sorting the object.

    ``details_json`` and ``server_view_json`` are already canonical (``validated_details``,
    ``canonical_bytes_validated``); canonical JSON nests, so the entry is its members in JCS order
    (code-point order of the fixed ASCII names, which UTF-16 order agrees with) around them. The
    hot path of every append: the writer hashes each entry with it, and a process appending through
    another's committer re-hashes what it got back. ``tests/audit/test_audit_canonical_fast.py``
    compares it with the general encoder on generated entries. Raises :class:`AuditEventError`
    where the general path does (text with no UTF-8 form).
    """
    if type(seq) is not int or abs(seq) > MAX_SAFE_INT:
        raise AuditEventError(f"audit seq {seq!r} is not an integer within ±(2^53-1)")
    esc = _ESCAPE
    view = "" if server_view_json is None else f'"server_view":{server_view_json},'
    text = (f'{{"action":{esc(action)},"actor":{esc(actor)},"details":{details_json},"hostname":{esc(hostname)},'
            f'"mac":{esc(mac)},"outcome":{esc(outcome)},"prev_hash":{esc(prev_hash)},"resource":{esc(resource)},'
            f'"seq":{seq},{view}"ts":{esc(ts)},"v":{FORMAT_VERSION}}}')
    try:
        return text.encode()
    except UnicodeError:  # a lone surrogate: no canonical form; the general path names the problem
        raise AuditEventError("audit entry text contains a lone UTF-16 surrogate (not valid Unicode text)") from None


def _refuse_number(_text: str) -> Any:
    raise ValueError("no floats or non-finite numbers in audit entries")


def _safe_int(text: str) -> int:
    value = int(text)
    if abs(value) > MAX_SAFE_INT:
        raise ValueError("integer outside the I-JSON range")
    return value


# Only integers of 16 or more digits can leave ±(2^53-1); without such a run the C scanner parses
# integers itself (the Python hook per integer is the slow part of a strict parse).
_PLAIN_SCAN = json.JSONDecoder(parse_float=_refuse_number, parse_constant=_refuse_number).decode
_CHECKED_SCAN = json.JSONDecoder(parse_float=_refuse_number, parse_constant=_refuse_number, parse_int=_safe_int).decode
_LONG_DIGITS = re.compile("[0-9]{16}").search


def parse_canonical_object(text: str) -> dict[str, Any] | None:
    """The JSON object ``text`` if it holds no float and no integer beyond ±(2^53-1) and is already
    in RFC 8785 form; else None (the caller takes its exact, slower path, which names the problem)."""
    try:
        value = (_CHECKED_SCAN if _LONG_DIGITS(text) else _PLAIN_SCAN)(text)
    except (TypeError, ValueError, RecursionError):
        return None
    if type(value) is not dict or canonical_bytes_validated(value) != text.encode():
        return None
    return value


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

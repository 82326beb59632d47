"""Checks of single entry lines, and the worker process of parallel verification.

Split from :mod:`securetrain.audit.verify` so a worker process imports only this (no ``cryptography``,
no key handling): its start-up is paid once per worker per verification.
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import json.scanner
import re
from typing import Any, cast

from securetrain.audit.canonical import (
    FORMAT_VERSION,
    HASHED_FIELDS,
    MAX_SAFE_INT,
    SERVER_VIEW,
    SERVER_VIEW_FIELDS,
    canonical_bytes,
)
from securetrain.audit.errors import AuditEventError, AuditIntegrityError

_STR_FIELDS = ("ts", "actor", "hostname", "mac", "action", "resource", "outcome", "prev_hash")


def fail(seq: int | None, problem: str, message: str) -> AuditIntegrityError:
    where = f"entry seq={seq}: " if seq is not None else ""
    return AuditIntegrityError(where + message, seq=seq, problem=problem)


def check_object(obj: Any, seq: int) -> None:
    """Structural checks of one hashed object (types, version, no floats)."""
    if not isinstance(obj, dict) or (set(obj) != _FIELDS and set(obj) != _FIELDS_WITH_VIEW):
        raise fail(seq, "fields", f"entry must have exactly the fields {sorted(HASHED_FIELDS)} "
                                   f"(and optionally {SERVER_VIEW!r})")
    if obj["v"] != FORMAT_VERSION or type(obj["v"]) is not int:
        raise fail(seq, "version", f"unknown format version {obj['v']!r}")
    if type(obj["seq"]) is not int:
        raise fail(seq, "seq", "seq is not an integer")
    for name in _STR_FIELDS:
        if not isinstance(obj[name], str):
            raise fail(seq, name, f"{name} is not a string")
    if not isinstance(obj["details"], dict):
        raise fail(seq, "details", "details is not an object")
    if _has_float(obj["details"]):
        raise fail(seq, "details", "details contain a float, which the format forbids")
    if SERVER_VIEW in obj:
        view = obj[SERVER_VIEW]
        if (not isinstance(view, dict) or set(view) != set(SERVER_VIEW_FIELDS) or not isinstance(view["role"], str)
                or not isinstance(view["time"], str) or not (view["addr"] is None or isinstance(view["addr"], str))):
            raise fail(seq, SERVER_VIEW, "server_view must be an object of exactly role (string), addr (string or "
                                          "null) and time (string)")


_FIELDS = frozenset(HASHED_FIELDS)
_FIELDS_WITH_VIEW = _FIELDS | {SERVER_VIEW}


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return False


# ---- fast acceptance of canonical entry lines -----------------------------------------------
# Most of the cost of verification used to be Python work per entry: parse the JSON, re-serialise
# it with an RFC 8785 implementation, compare. The fast path below accepts a line only when it can
# *prove* the line is the canonical form of a well-typed entry, using C-implemented pieces:
#   * strict UTF-8 decoding (no lone surrogates can survive it);
#   * one regular expression for the fixed top level: the eleven members in JCS order (twelve with a
#     server_view of exactly addr/role/time), every string in the exact JCS escaping (only \" \\ \b
#     \t \n \f \r and \u00xx for other controls), seq in plain decimal, "v":1;
#   * details: json (C scanner) with floats/NaN/out-of-range integers refused, re-encoded by the C
#     encoder with sorted keys; for text without characters beyond U+FFFF, code-point order is
#     UTF-16 order and the encoder's escaping is JCS's, so equality means canonical.
# Anything the fast path does not accept goes through the exact slow path (full parse, RFC 8785,
# named failure), which decides; so the fast path can only make verification faster, not laxer.
# A JCS string, "unrolled" so runs of ordinary characters are one fast character-class loop.
_JCS_STRING = r'"[^"\\\x00-\x1f]*(?:\\(?:["\\bfnrt]|u00(?:0[0-7bef]|1[0-9a-f]))[^"\\\x00-\x1f]*)*"'
ENTRY_HEAD = re.compile(r'\{"action":' + _JCS_STRING + r',"actor":' + _JCS_STRING + r',"details":\{').match
# Everything after details. In canonical JSON no string can hold '},"hostname":"' (its quotes would be
# escaped), so the last occurrence of that text is where details ends.
ENTRY_TAIL = re.compile(
    r',"hostname":' + _JCS_STRING + r',"mac":' + _JCS_STRING + r',"outcome":' + _JCS_STRING
    + r',"prev_hash":"([0-9a-f]{64})","resource":' + _JCS_STRING + r',"seq":(0|[1-9][0-9]{0,15})'
    + r'(?:,"server_view":\{"addr":(?:null|' + _JCS_STRING + r'),"role":' + _JCS_STRING + r',"time":' + _JCS_STRING
    + r'\})?,"ts":' + _JCS_STRING + r',"v":1\}').fullmatch
ASTRAL = re.compile("[\U00010000-\U0010ffff]").search
#: A stored server view in canonical form (a database row's ``server_view`` text).
SERVER_VIEW_TEXT = re.compile(r'\{"addr":(?:null|' + _JCS_STRING + r'),"role":' + _JCS_STRING + r',"time":'
                              + _JCS_STRING + r'\}').fullmatch


def _refuse(_text: str) -> Any:
    raise ValueError("not allowed in audit entries")


def _safe_int(text: str) -> int:
    value = int(text)
    if -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
        return value
    raise ValueError("integer outside the I-JSON range")


_DETAILS_DECODER = json.JSONDecoder(parse_float=_refuse, parse_int=_safe_int, parse_constant=_refuse)
_DETAILS_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False)
# The C scanner/encoder called directly: JSONDecoder.decode and JSONEncoder.encode add Python-level
# wrapper work per call that costs more than the parsing itself for a small details object.
# (Private CPython helpers, absent from typeshed: reached through getattr, typed Any.)
_c_make_scanner: Any = getattr(json.scanner, "c_make_scanner", None)
_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_scan_details = (_c_make_scanner(_DETAILS_DECODER) if _c_make_scanner
                 else cast(Any, _DETAILS_DECODER).scan_once)
# Without a Python parse_int hook the C scanner parses integers itself; the caller then checks
# their range (see details_canonical).
_PLAIN_DECODER = json.JSONDecoder(parse_float=_refuse, parse_constant=_refuse)
_scan_plain = _c_make_scanner(_PLAIN_DECODER) if _c_make_scanner else cast(Any, _PLAIN_DECODER).scan_once
_LONG_DIGITS = re.compile("[0-9]{16}").search
_c_encode = (_c_make_encoder(None, None, json.encoder.encode_basestring, None, ":", ",", True, False, False)
             if _c_make_encoder else None)


def details_canonical(text: str) -> bool:
    if text == "{}":
        return True
    try:
        obj, end = _scan_plain(text, 0)
        if end != len(text) or type(obj) is not dict:
            return False
        for value in obj.values():  # integers must lie within ±(2^53-1)
            kind = type(value)
            if kind is int:
                if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
                    return False
            elif kind is not str and kind is not bool and value is not None:
                # Nested: integers anywhere. Re-parsed with the range-checking hook when a run of 16
                # digits (the only integers that can exceed 2^53-1) occurs in the text. (A flat
                # object is checked above: cheaper than searching the text for such a run.)
                if _LONG_DIGITS(text):
                    obj = _scan_details(text, 0)[0]
                break
        return ("".join(_c_encode(obj, 0)) if _c_encode else _DETAILS_ENCODER.encode(obj)) == text
    except (ValueError, RecursionError, StopIteration):
        return False


def fast_accept(raw: bytes, seq: int, prev_hash: str) -> bool:
    """True when ``raw`` is certainly the canonical entry number ``seq`` chained onto ``prev_hash``.

    False means "not proven here": the caller must run the exact check (:func:`check_entry`).
    """
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return False
    head = ENTRY_HEAD(text)
    end = text.rfind('},"hostname":"')
    if head is None or end < head.end() - 1:
        return False
    tail = ENTRY_TAIL(text, end + 1)
    return (tail is not None and tail[1] == prev_hash and tail[2] == str(seq)
            and (text.isascii() or ASTRAL(text) is None) and details_canonical(text[head.end() - 1 : end + 1]))


def prev_hash_mismatch(seq: int) -> str:
    """The words for a broken chain at ``seq`` (the standalone verifier, audit/verify_audit.py, says
    the same: an auditor comparing the two reports reads one sentence)."""
    if seq == 0:
        return "prev_hash is not the genesis hash (entry 0 was altered, or entries before it were added)"
    return (f"prev_hash does not match the hash of entry {seq - 1} (entry {seq - 1} or {seq} was altered, "
            "or entries were removed)")


def check_entry(raw: bytes, obj: Any, seq: int, prev_hash: str, *, raw_is_canonical: bool = False) -> None:
    """The exact (slow) check of one entry; raises :class:`AuditIntegrityError` naming the problem.

    ``raw_is_canonical``: the caller encoded ``raw`` from ``obj`` itself, canonically (database rows)."""
    check_object(obj, seq)
    if obj["seq"] != seq:
        raise fail(seq, "seq", f"entry claims seq {obj['seq']}, expected {seq} (entry deleted, inserted or reordered)")
    if raw_is_canonical:
        if obj["prev_hash"] != prev_hash:
            raise fail(seq, "prev_hash", prev_hash_mismatch(seq))
        return
    try:
        canonical = canonical_bytes(obj)
    except AuditEventError:  # e.g. an integer beyond 2^53 or a lone surrogate: tampered data
        raise fail(seq, "canonical", "entry holds a value with no RFC 8785 canonical form "
                                      "(integer outside +/-(2^53-1) or lone surrogate)") from None
    if canonical != raw:
        raise fail(seq, "canonical", "entry bytes are not RFC 8785 canonical JSON (edited by hand?)")
    if obj["prev_hash"] != prev_hash:
        raise fail(seq, "prev_hash", prev_hash_mismatch(seq))


def parse_line(raw: bytes, seq: int) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise fail(seq, "json", "entry is not valid JSON") from None


def chunk_worker_main(argv: list[str]) -> None:
    """Worker process of :func:`verify_file_parallel`: ``PATH SIZE STEP K W`` checks ranges K, K+W, ..."""
    import sys

    path, (size, step, first, stride) = argv[0], map(int, argv[1:])
    out = sys.stdout.buffer
    for lo in range(first * step, size, stride * step):
        count, seq0, prev0, last, leaves, ok = verify_chunk(read_chunk_lines(path, lo, min(lo + step, size)))
        out.write(json.dumps([count, ok, seq0, prev0, last]).encode() + b"\n")
        if ok:
            out.write(b"".join(leaves))
        out.flush()


def read_chunk_lines(path: str, start: int, end: int) -> list[bytes]:
    """The lines whose first byte lies in ``[start, end)``, newline stripped."""
    with open(path, "rb") as handle:
        if start > 0:
            handle.seek(start - 1)
            if handle.read(1) != b"\n":
                handle.readline()  # the rest of a line that began in the previous range
        pos = handle.tell()
        if pos >= end:
            return []
        data = handle.read(end - pos)
        if not data.endswith(b"\n"):
            data += handle.readline()  # the line that crosses the end belongs here
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def verify_chunk(lines: list[bytes]) -> tuple:
    """Check lines relative to the first one's own ``seq``/``prev_hash`` claims (run in a worker).

    Returns ``(count, first_seq, first_prev, last_entry_hash, leaf_hashes, ok)``.
    """
    if not lines:
        return 0, None, None, None, [], True
    try:
        first = json.loads(lines[0])
        seq0, prev0 = first["seq"], first["prev_hash"]
        if type(seq0) is not int or type(prev0) is not str:
            raise TypeError
    except Exception:  # noqa: BLE001 - any problem: the caller re-checks this chunk sequentially
        return len(lines), None, None, None, [], False
    sha256 = hashlib.sha256
    seq, prev, leaves = seq0, prev0, []
    for raw in lines:
        if not fast_accept(raw, seq, prev):
            try:
                check_entry(raw, parse_line(raw, seq), seq, prev)
            except AuditIntegrityError:
                return len(lines), seq0, prev0, None, [], False
        prev = sha256(raw).hexdigest()
        leaves.append(sha256(b"\x00" + raw).digest())
        seq += 1
    return len(lines), seq0, prev0, prev, leaves, True

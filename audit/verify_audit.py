#!/usr/bin/env python3
"""Standalone verifier for securetrain audit-log exports.

Needs only Python >= 3.11 and the ``cryptography`` package; it deliberately imports nothing from
securetrain (and not rfc8785) so an auditor can read all of it. Usage::

    python verify_audit.py EXPORT_DIR (--vkey KEY | --public-key PEM | --trust-embedded-key) \
        [--trusted-checkpoint OLD.note ...] [--since-checkpoint HELD.note] [--html report.html] [--json]

    python verify_audit.py --proof PROOF.json (--vkey KEY | --public-key PEM) [--trusted-checkpoint HELD.note]

--vkey/--public-key are repeatable. After an audit-key rotation, checkpoints by the new key are
accepted through the export's handovers.notes (signed by the old and the new key), starting from
the key(s) you trust; the old key's checkpoints after the hand-over size are refused. A proof
from 'securetrain audit prove' carries the same hand-over notes (its "handovers"), each with a
consistency proof to the proven tree.

Exit status: 0 verified against the key you pinned, 1 verification failed (first bad entry named),
2 usage or I/O error, 3 self-consistent only: checked against the export's own public_key.pem
(UNTRUSTED: a forger re-signs with a new key), unless --trust-embedded-key accepts that.
The format is specified in docs/audit-format.md.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import html
import json
import json.encoder
import json.scanner
import os
import re
import subprocess
import sys
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

GENESIS = "0" * 64
FIELDS = {"v", "seq", "ts", "actor", "hostname", "mac", "action", "resource", "outcome", "details", "prev_hash"}
# Optional: the database server's view of the writer (PostgreSQL logs), hashed like every other field.
SERVER_VIEW_FIELDS = {"role", "addr", "time"}
STR_FIELDS = ("ts", "actor", "hostname", "mac", "action", "resource", "outcome", "prev_hash")
EM_DASH = "\u2014"


class Failure(Exception):
    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


# ---- RFC 8785 canonical JSON, for the value types the log writes (no floats) -------------
def _jcs_string(s: str) -> str:
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif o < 0x20:
            out.append({8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r"}.get(o, f"\\u{o:04x}"))
        elif 0xD800 <= o <= 0xDFFF:
            raise Failure("string contains a lone surrogate")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def jcs(value: object) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        if abs(value) > 2**53 - 1:
            raise Failure("integer outside the I-JSON range")
        return str(value)
    if isinstance(value, float):
        raise Failure("floats are not allowed in audit entries")
    if isinstance(value, str):
        return _jcs_string(value)
    if isinstance(value, list):
        return "[" + ",".join(jcs(v) for v in value) + "]"
    if isinstance(value, dict):
        for k in value:
            _jcs_string(k)  # refuse lone surrogates before sorting (UTF-16 cannot encode them)
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))  # RFC 8785: UTF-16 code units
        return "{" + ",".join(_jcs_string(k) + ":" + jcs(value[k]) for k in keys) + "}"
    raise Failure(f"unexpected JSON type {type(value).__name__}")


# ---- RFC 6962 Merkle tree ---------------------------------------------------------------
def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


class Tree:
    """Incremental root: peaks of perfect subtrees, folded right to left."""

    def __init__(self) -> None:
        self.size, self.peaks = 0, []

    def append(self, leaf: bytes) -> None:
        node, n = leaf, self.size
        while n & 1:
            node = node_hash(self.peaks.pop(), node)
            n >>= 1
        self.peaks.append(node)
        self.size += 1

    def push(self, node: bytes, height: int) -> None:
        """Append a perfect subtree of 2**height leaves (size must be a multiple of 2**height)."""
        n = self.size >> height
        while n & 1:
            node = node_hash(self.peaks.pop(), node)
            n >>= 1
        self.peaks.append(node)
        self.size += 1 << height

    def extend(self, leaves: list) -> None:
        """Same as append() for each leaf; aligned perfect subtrees are hashed level by level."""
        i, n = 0, len(leaves)
        while i < n:
            height = (n - i).bit_length() - 1
            if self.size:
                height = min(height, (self.size & -self.size).bit_length() - 1)
            level = leaves[i : i + (1 << height)]
            while len(level) > 1:
                pairs = iter(level)
                level = [hashlib.sha256(b"\x01" + a + b).digest() for a, b in zip(pairs, pairs)]
            self.push(level[0], height)
            i += 1 << height

    def root(self) -> bytes:
        if not self.peaks:
            return hashlib.sha256(b"").digest()
        acc = self.peaks[-1]
        for peak in reversed(self.peaks[:-1]):
            acc = node_hash(peak, acc)
        return acc


# ---- RFC 6962 proofs (a port of transparency-dev/merkle proof/verify.go) -------------------
def _chain_inner(seed: bytes, proof: list, index: int) -> bytes:
    for i, h in enumerate(proof):
        seed = node_hash(seed, h) if (index >> i) & 1 == 0 else node_hash(h, seed)
    return seed


def _chain_inner_right(seed: bytes, proof: list, index: int) -> bytes:
    for i, h in enumerate(proof):
        if (index >> i) & 1:
            seed = node_hash(h, seed)
    return seed


def _chain_border_right(seed: bytes, proof: list) -> bytes:
    for h in proof:
        seed = node_hash(h, seed)
    return seed


def _decomp(index: int, size: int) -> tuple[int, int]:
    inner = (index ^ (size - 1)).bit_length()
    return inner, bin(index >> inner).count("1")


def verify_inclusion(index: int, size: int, leaf: bytes, proof: list, root: bytes) -> bool:
    if not 0 <= index < size or len(leaf) != 32 or any(len(p) != 32 for p in proof):
        return False
    inner, border = _decomp(index, size)
    if len(proof) != inner + border:
        return False
    return _chain_border_right(_chain_inner(leaf, proof[:inner], index), proof[inner:]) == root


def verify_consistency(size1: int, size2: int, proof: list, root1: bytes, root2: bytes) -> bool:
    """size1 = 0 is rejected: a proof from the empty tree proves nothing."""
    if size1 <= 0 or size2 < size1 or any(len(p) != 32 for p in proof):
        return False
    if size1 == size2:
        return not proof and root1 == root2
    if not proof:
        return False
    fork, border = _decomp(size1 - 1, size2)
    shift = (size1 & -size1).bit_length() - 1
    inner = fork - shift
    seed, start = (root1, 0) if size1 == 1 << shift else (proof[0], 1)
    if len(proof) != start + inner + border:
        return False
    rest, mask = proof[start:], (size1 - 1) >> shift
    if start == 1:  # the proof's nodes inside the old tree must rebuild root1
        sub_inner = min((size1 - 1).bit_length(), ((size1 - 1) ^ (size2 - 1)).bit_length()) - shift
        if _chain_border_right(_chain_inner_right(seed, rest[:sub_inner], mask), rest[inner:inner + border]) != root1:
            return False
    return _chain_border_right(_chain_inner(seed, rest[:inner], mask), rest[inner:]) == root2


# ---- fast acceptance of canonical entry lines --------------------------------------------
# A line is accepted here only when it is provably the canonical entry `seq` chained onto `prev`:
# strict UTF-8, one regular expression for the eleven top-level members (twelve with a server_view of
# exactly addr/role/time) in JCS order with JCS string escaping, and the details object re-encoded by the C json encoder (sorted keys, floats
# and out-of-range integers refused) - identical to JCS when no character lies beyond U+FFFF.
# Everything else goes through exact_check() below, which decides and names the problem.
JCS_STRING = r'"[^"\\\x00-\x1f]*(?:\\(?:["\\bfnrt]|u00(?:0[0-7bef]|1[0-9a-f]))[^"\\\x00-\x1f]*)*"'
ENTRY_HEAD = re.compile(r'\{"action":' + JCS_STRING + r',"actor":' + JCS_STRING + r',"details":\{').match
# No canonical string can hold '},"hostname":"' (its quotes would be escaped): the last one ends details.
ENTRY_TAIL = re.compile(
    r',"hostname":' + JCS_STRING + r',"mac":' + JCS_STRING + r',"outcome":' + JCS_STRING
    + r',"prev_hash":"([0-9a-f]{64})","resource":' + JCS_STRING + r',"seq":(0|[1-9][0-9]{0,15})'
    + r'(?:,"server_view":\{"addr":(?:null|' + JCS_STRING + r'),"role":' + JCS_STRING + r',"time":' + JCS_STRING
    + r'\})?,"ts":' + JCS_STRING + r',"v":1\}').fullmatch
ASTRAL = re.compile("[\U00010000-\U0010ffff]").search


def _refuse(_text: str) -> None:
    raise ValueError("not allowed in audit entries")


MAX_INT = 2**53 - 1


def _safe_int(text: str) -> int:
    value = int(text)
    if abs(value) > MAX_INT:
        raise ValueError("integer outside the I-JSON range")
    return value


DETAILS_DECODER = json.JSONDecoder(parse_float=_refuse, parse_int=_safe_int, parse_constant=_refuse)
DETAILS_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True)
# The C scanner and encoder, called directly (JSONDecoder.decode/JSONEncoder.encode add Python work).
scan_details = json.scanner.c_make_scanner(DETAILS_DECODER) if json.scanner.c_make_scanner else DETAILS_DECODER.scan_once
# Without the Python parse_int hook the C scanner parses integers itself; details_canonical then
# checks their range.
PLAIN_DECODER = json.JSONDecoder(parse_float=_refuse, parse_constant=_refuse)
scan_plain = json.scanner.c_make_scanner(PLAIN_DECODER) if json.scanner.c_make_scanner else PLAIN_DECODER.scan_once
LONG_DIGITS = re.compile("[0-9]{16}").search
c_encode = (json.encoder.c_make_encoder(None, None, json.encoder.encode_basestring, None, ":", ",", True, False, False)
            if json.encoder.c_make_encoder else None)


def details_canonical(text: str) -> bool:
    if text == "{}":
        return True
    try:
        obj, end = scan_plain(text, 0)
        if end != len(text) or type(obj) is not dict:
            return False
        for value in obj.values():  # integers must lie within +-(2^53-1)
            kind = type(value)
            if kind is int:
                if not -MAX_INT <= value <= MAX_INT:
                    return False
            elif kind is not str and kind is not bool and value is not None:
                # nested: integers anywhere; re-parsed with the range-checking hook when any run of
                # 16 digits (the only integers that can exceed 2^53-1) occurs in the text
                if LONG_DIGITS(text):
                    obj = scan_details(text, 0)[0]
                break
        return ("".join(c_encode(obj, 0)) if c_encode else DETAILS_ENCODER.encode(obj)) == text
    except (ValueError, RecursionError, StopIteration):
        return False


def fast_ok(raw: bytes, seq: int, prev: str) -> bool:
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return False
    head, end = ENTRY_HEAD(text), text.rfind('},"hostname":"')
    if head is None or end < head.end() - 1:
        return False
    tail = ENTRY_TAIL(text, end + 1)
    if tail is None or tail[1] != prev or tail[2] != str(seq) or (not text.isascii() and ASTRAL(text)):
        return False
    return details_canonical(text[head.end() - 1 : end + 1])


def has_float(value: object) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(has_float(v) for v in value.values())
    return isinstance(value, list) and any(has_float(v) for v in value)


def prev_hash_mismatch(seq: int) -> str:
    """The words for a broken chain at ``seq``; the same as 'securetrain audit verify' prints."""
    if seq == 0:
        return "prev_hash is not the genesis hash (entry 0 was altered, or entries before it were added)"
    return f"prev_hash does not match the hash of entry {seq - 1} (entry {seq - 1} or {seq} was altered, " \
           "or entries were removed)"


def exact_check(raw: bytes, seq: int, prev: str) -> None:
    """The specification, check by check (docs/audit-format.md); raises Failure naming the problem.

    Checks and words are those of 'securetrain audit verify' (securetrain/audit/entrycheck.py), in the
    same order, so both name a broken entry in the same sentence."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Failure("entry is not valid JSON", seq) from None
    if not isinstance(obj, dict) or (set(obj) != FIELDS and set(obj) != FIELDS | {"server_view"}):
        raise Failure(f"entry must have exactly the fields {sorted(FIELDS)} (and optionally 'server_view')", seq)
    if obj["v"] != 1 or type(obj["v"]) is not int:
        raise Failure(f"unknown format version {obj['v']!r}", seq)
    if type(obj["seq"]) is not int:
        raise Failure("seq is not an integer", seq)
    for name in STR_FIELDS:
        if not isinstance(obj[name], str):
            raise Failure(f"{name} is not a string", seq)
    if not isinstance(obj["details"], dict):
        raise Failure("details is not an object", seq)
    if has_float(obj["details"]):
        raise Failure("details contain a float, which the format forbids", seq)
    view = obj.get("server_view", {"role": "", "addr": None, "time": ""})
    if (not isinstance(view, dict) or set(view) != SERVER_VIEW_FIELDS or not isinstance(view["role"], str)
            or not isinstance(view["time"], str) or not (view["addr"] is None or isinstance(view["addr"], str))):
        raise Failure("server_view must be an object of exactly role (string), addr (string or null) and time "
                      "(string)", seq)
    if obj["seq"] != seq:
        raise Failure(f"entry claims seq {obj['seq']}, expected {seq} (entry deleted, inserted or reordered)", seq)
    try:
        canonical = jcs(obj).encode()
    except Failure:
        raise Failure("entry holds a value with no RFC 8785 canonical form (integer outside +/-(2^53-1) or lone "
                      "surrogate)", seq) from None
    if canonical != raw:
        raise Failure("entry bytes are not RFC 8785 canonical JSON (edited by hand?)", seq)
    if obj["prev_hash"] != prev:
        raise Failure(prev_hash_mismatch(seq), seq)


MAX_LINE = 1 << 20


def line_batches(handle, digest):  # noqa: ANN001, ANN201
    """Lines (newline stripped) in batches, reading 1 MiB at a time; feeds every byte to digest."""
    carry = b""
    number = 0  # lines yielded so far: the long line's seq
    while True:
        buf = handle.read(1 << 20)
        if not buf:
            break
        digest.update(buf)
        parts = (carry + buf).split(b"\n")
        carry = parts.pop()
        if len(carry) > MAX_LINE:
            raise Failure(f"entry line longer than {MAX_LINE} bytes", number + len(parts))
        number += len(parts)
        yield parts
    if carry:
        yield [carry]


def read_chunk_lines(path: str, start: int, end: int) -> list:
    """The lines whose first byte lies in [start, end), newline stripped."""
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


def chunk_worker_main(argv: list) -> None:
    """Worker process (``--chunk-worker PATH SIZE STEP K W``): checks byte ranges K, K+W, ... and writes, per
    range, a JSON header [count, ok, seq0, prev0, last] and then the range's 32-byte leaf hashes."""
    path, (size, step, first, stride) = argv[0], map(int, argv[1:])
    out = sys.stdout.buffer
    for lo in range(first * step, size, stride * step):
        count, seq0, prev0, last, leaves, ok = chunk_worker(read_chunk_lines(path, lo, min(lo + step, size)))
        out.write(json.dumps([count, ok, seq0, prev0, last]).encode() + b"\n")
        if ok:
            out.write(b"".join(leaves))
        out.flush()


def read_chunk_result(stream) -> tuple | None:  # noqa: ANN001
    """One range's result from a worker (as chunk_worker returns it), or None if the worker broke off."""
    try:
        count, ok, seq0, prev0, last = json.loads(stream.readline())
        if not ok:
            return count, None, None, None, [], False
        blob = stream.read(32 * count)
        if type(count) is not int or len(blob) != 32 * count:
            return None
        return count, seq0, prev0, last, [blob[j : j + 32] for j in range(0, len(blob), 32)], True
    except (ValueError, TypeError, OSError):
        return None


def chunk_worker(lines: list) -> tuple:
    """Check lines relative to the first one's own seq/prev_hash: (count, seq0, prev0, last, leaves, ok)."""
    if not lines:
        return 0, None, None, None, [], True
    try:
        first = json.loads(lines[0])
        seq0, prev0 = first["seq"], first["prev_hash"]
        if type(seq0) is not int or type(prev0) is not str:
            raise TypeError
    except Exception:  # noqa: BLE001 - the caller re-checks this range sequentially
        return len(lines), None, None, None, [], False
    seq, prev, leaves = seq0, prev0, []
    for raw in lines:
        if not fast_ok(raw, seq, prev):
            try:
                exact_check(raw, seq, prev)
            except Failure:
                return len(lines), seq0, prev0, None, [], False
        prev = hashlib.sha256(raw).hexdigest()
        leaves.append(hashlib.sha256(b"\x00" + raw).digest())
        seq += 1
    return len(lines), seq0, prev0, prev, leaves, True


# ---- signed notes / checkpoints (c2sp.org/signed-note, c2sp.org/tlog-checkpoint) ----------
def key_id(name: str, pub: Ed25519PublicKey) -> bytes:
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(name.encode() + b"\n\x01" + raw).digest()[:4]


def raw_key(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def note_signatures(note: str, what: str) -> tuple[str, list]:
    """A signed note's text and its signature lines as (key name, key ID, signature)."""
    if not note.endswith("\n") or "\n\n" not in note or any(ord(c) < 0x20 and c != "\n" for c in note):
        raise Failure(f"{what}: malformed signed note")
    split = note.rfind("\n\n")
    text, sigs = note[: split + 1], []
    for line in note[split + 2 :].splitlines():
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != EM_DASH:
            raise Failure(f"{what}: malformed signature line")
        try:
            blob = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            raise Failure(f"{what}: signature is not base64") from None
        sigs.append((parts[1], blob[:4], blob[4:]))
    return text, sigs


class Keys:
    """Accepted keys, each allowed to sign checkpoints of sizes [start, end] (end None: open).

    Built from the auditor's trusted keys, extended by key hand-overs (docs/audit-format.md).
    """

    def __init__(self, trusted: list) -> None:
        self.windows = {raw_key(k): [k, 0, None, True] for k in trusted}  # pub, start, end, pinned
        self.points: list = []  # (origin, size, root) of every hand-over followed

    def follow(self, note: str, what: str) -> None:
        """Accept the new key of a hand-over signed by an accepted old key and by the new key."""
        origin, size, root, old_vkey, new_vkey = parse_handover(note, what)
        old_pub, new_pub = parse_vkey(old_vkey)[1], parse_vkey(new_vkey)[1]
        if raw_key(old_pub) == raw_key(new_pub):
            raise Failure(f"{what}: the hand-over at size {size} rotates to the same key")
        text, sigs = note_signatures(note, what)
        for label, vkey in (("old", old_vkey), ("new", new_vkey)):
            name, pub = parse_vkey(vkey)
            found = False
            for sig_name, kid, sig in sigs:
                if sig_name == name and kid == key_id(name, pub):
                    try:
                        pub.verify(sig, text.encode())
                    except InvalidSignature:
                        raise Failure(f"{what}: hand-over signature by the {label} key does not verify "
                                      "(forged or altered)") from None
                    found = True
            if not found:
                raise Failure(f"{what}: the hand-over at size {size} is not signed by the {label} key"
                              + (" (only the retiring key can authorise a new one)" if label == "old"
                                 else " (no proof of possession)"))
        old = self.windows.get(raw_key(old_pub))
        if old is None:
            raise Failure(f"{what}: the hand-over at size {size} comes from a key that is neither trusted nor "
                          "handed over to (pass the key you trusted before the rotation too)")
        if old[2] is not None:
            raise Failure(f"{what}: the old key was already retired at size {old[2]} (second hand-over)")
        last = self.points[-1][1] if self.points else 0
        if size < max(last, old[1]):
            raise Failure(f"{what}: the hand-over at size {size} precedes an earlier one")
        new = self.windows.get(raw_key(new_pub))
        if new is not None and (not new[3] or new[2] is not None):
            raise Failure(f"{what}: the hand-over at size {size} rotates to a key that was already in use")
        old[2] = size
        if new is not None:
            new[1] = size
        else:
            self.windows[raw_key(new_pub)] = [new_pub, size, None, False]
        self.points.append((origin, size, root))


HANDOVER_HEADER = "securetrain.audit/key-handover/v1"


def parse_handover(note: str, what: str) -> tuple[str, int, bytes, str, str]:
    """(origin, tree size, root, old verifier key, new verifier key) of a hand-over note (not verified)."""
    lines = note_signatures(note, what)[0].split("\n")
    if len(lines) != 7 or lines[0] != HANDOVER_HEADER or lines[6] != "":
        raise Failure(f"{what}: not a {HANDOVER_HEADER} note")
    origin, size_s, root_s, old_line, new_line = lines[1:6]
    if not origin or not re.fullmatch(r"0|[1-9][0-9]{0,15}", size_s):
        raise Failure(f"{what}: hand-over origin or tree size is malformed")
    try:
        root = base64.b64decode(root_s, validate=True)
    except binascii.Error:
        root = b""
    if len(root) != 32 or not old_line.startswith("old ") or not new_line.startswith("new "):
        raise Failure(f"{what}: hand-over root or key lines are malformed")
    return origin, int(size_s), root, old_line[4:], new_line[4:]


def parse_vkey(value: str) -> tuple[str, Ed25519PublicKey]:
    parts = value.strip().split("+", 2)  # base64 may contain "+"
    if len(parts) != 3:
        raise Failure("verifier key must look like name+hexid+base64key")
    name, hex_id, b64 = parts
    try:
        raw = base64.b64decode(b64, validate=True)
    except binascii.Error:
        raise Failure("verifier key is not base64") from None
    if len(raw) != 33 or raw[0] != 1:
        raise Failure("verifier key is not Ed25519")
    pub = Ed25519PublicKey.from_public_bytes(raw[1:])
    if key_id(name, pub).hex() != hex_id:
        raise Failure("verifier key id does not match its name and key")
    return name, pub


def open_checkpoint(note: str, keys, what: str) -> tuple[str, int, bytes]:  # noqa: ANN001
    """Verify a checkpoint with an accepted key (``keys``: a public key or Keys) whose window holds its size."""
    if not isinstance(keys, Keys):
        keys = Keys([keys])
    text, sigs = note_signatures(note, what)
    matched = []
    for name, kid, sig in sigs:
        for window in keys.windows.values():
            if kid != key_id(name, window[0]):
                continue  # unknown key: ignored, as the spec requires
            try:
                window[0].verify(sig, text.encode())
            except InvalidSignature:
                raise Failure(f"{what}: signature by {name} does not verify (forged or altered)") from None
            matched.append(window)
    if not matched:
        raise Failure(f"{what}: not signed by the trusted key (re-signed log or wrong key)")
    lines = text.split("\n")
    if len(lines) < 4 or any(not x for x in lines[:-1]) or not re.fullmatch(r"0|[1-9][0-9]*", lines[1]):
        raise Failure(f"{what}: checkpoint body must be origin, tree size, root hash")
    try:
        root = base64.b64decode(lines[2], validate=True)
    except binascii.Error:
        root = b""
    if len(root) != 32:
        raise Failure(f"{what}: checkpoint root is not a base64 SHA-256 hash")
    size = int(lines[1])
    if not any(w[1] <= size and (w[2] is None or size <= w[2]) for w in matched):
        end = matched[0][2]
        if end is not None and size > end:
            raise Failure(f"{what}: checkpoint of size {size} is signed by a key retired at hand-over size {end}")
        raise Failure(f"{what}: checkpoint of size {size} is signed by a key that took over only at size "
                      f"{matched[0][1]}")
    return lines[0], size, root


def split_notes(blob: str) -> list[str]:
    notes, cur, in_sigs = [], [], False
    for line in blob.splitlines(keepends=True):
        if in_sigs and not line.startswith(EM_DASH + " "):
            notes.append("".join(cur))
            cur, in_sigs = [], False
        cur.append(line)
        if line == "\n":
            in_sigs = True
    if cur:
        notes.append("".join(cur))
    return [n for n in notes if n.strip()]


def held_notes(path: str) -> list[str]:
    """The notes of a held checkpoint file (one note or an anchor file of them); none at all is a failure,
    never a silently skipped trust input."""
    notes = split_notes(Path(path).read_text(encoding="utf-8"))
    if not notes:
        raise Failure(f"held checkpoint {path} holds no checkpoint note")
    return notes


def load_keys(args: argparse.Namespace, export: Path, warnings: list[str], handovers: list,
              label: str = "handovers.notes") -> tuple[Keys, bool]:
    """The keys to verify with (hand-overs followed), and whether the auditor pinned them (not the export)."""
    def as_list(value) -> list:  # noqa: ANN001 - callers such as verify_provenance.py pass one string
        return [] if not value else [value] if isinstance(value, str) else list(value)

    keys = []
    for value in as_list(args.vkey):
        # A verifier key always holds '+'; anything else names a file, and a missing one is
        # unreadable input (exit 2), not a malformed key (exit 1).
        keys.append(parse_vkey(Path(value).read_text() if Path(value).is_file() or "+" not in value else value)[1])
    paths = [Path(p) for p in as_list(args.public_key)]
    if not keys and not paths:
        warnings.append("UNTRUSTED: using the export's own public_key.pem, which proves self-consistency only; "
                        "pass --vkey/--public-key you obtained independently")
        paths = [export / "public_key.pem"]
    for path in paths:
        key = serialization.load_pem_public_key(path.read_bytes())
        if not isinstance(key, Ed25519PublicKey):
            raise Failure("public key is not Ed25519")
        keys.append(key)
    pinned = bool(args.vkey or args.public_key)
    if not pinned:  # the embedded key is the newest one: walk its hand-overs back to the first key
        current = keys[0]
        for note in reversed(handovers):
            try:
                _, _, _, old_vkey, new_vkey = parse_handover(note, label)
                if raw_key(parse_vkey(new_vkey)[1]) == raw_key(current):
                    current = parse_vkey(old_vkey)[1]
            except Failure:
                continue
        keys = [current]
    chain = Keys(keys)
    for i, note in enumerate(handovers):
        chain.follow(note, f"{label} #{i}")
    return chain, pinned


# ---- the verification run -----------------------------------------------------------------
def default_workers(size: int) -> int:
    """1 for entries.jsonl under 8 MiB (~20,000 entries: starting workers costs more), else the usable CPUs (<= 8)."""
    if size < 8 << 20:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def verify(args: argparse.Namespace) -> dict:
    export = Path(args.export)
    warnings: list[str] = []
    checks: list[str] = []
    result = {"ok": False, "entries": 0, "root_hash": None, "error": None, "seq": None, "warnings": warnings,
              "checks": checks, "trusted": False}
    try:
        manifest = json.loads((export / "manifest.json").read_text())
        if manifest.get("format") != "securetrain-audit-export" or manifest.get("version") != 1:
            raise Failure("manifest.json: unknown export format")
        if "entries.jsonl" not in manifest["files"]:
            raise Failure("manifest.json lists no digest for entries.jsonl")
        for name, want in sorted(manifest["files"].items()):
            if name == "entries.jsonl":
                continue  # hashed while it is streamed below
            if "/" in name or hashlib.sha256((export / name).read_bytes()).hexdigest() != want:
                raise Failure(f"{name}: SHA-256 does not match manifest.json")
        handovers_path = export / "handovers.notes"  # absent in exports made before key rotation existed
        handovers = split_notes(handovers_path.read_text(encoding="utf-8")) if handovers_path.is_file() else []
        pub, result["trusted"] = load_keys(args, export, warnings, handovers)
        if handovers:
            checks.append(f"{len(handovers)} key hand-overs verify (signed by the old and the new key, "
                          "starting from the trusted key)")
        pending = [(*point, "hand-over") for point in pub.points]
        for i, note in enumerate(split_notes((export / "checkpoints.note").read_text(encoding="utf-8"))):
            pending.append((*open_checkpoint(note, pub, f"stored checkpoint #{i}"), "stored"))
        for path in args.trusted_checkpoint or []:
            for note in held_notes(path):
                pending.append((*open_checkpoint(note, pub, f"trusted checkpoint {path}"), "trusted"))
        checks.append(f"{len(pending) - len(pub.points)} checkpoint signatures verify (Ed25519)")
        origins = {p[0] for p in pending}
        if len(origins) > 1:
            raise Failure(f"checkpoints come from different logs: {sorted(origins)}")
        pending.sort(key=lambda p: p[1])
        tree, prev, covered = Tree(), GENESIS, 0

        def add(leaves: list) -> None:  # append leaves, stopping at every checkpoint size
            nonlocal covered
            i = 0
            while True:
                while pending and pending[0][1] == tree.size:
                    _, size, root, kind = pending.pop(0)
                    if root != tree.root():
                        raise Failure(f"Merkle root of the first {size} entries does not match the {kind} checkpoint "
                                      "(history before it was rewritten)", size - 1 if size else None)
                    covered = max(covered, size)
                if i == len(leaves):
                    return
                stop = min(len(leaves), i + pending[0][1] - tree.size) if pending else len(leaves)
                tree.extend(leaves[i:stop])
                i = stop

        digest = hashlib.sha256()
        sha256 = hashlib.sha256
        with open(export / "entries.jsonl", "rb") as handle:
            if args.since_checkpoint:
                tree, prev = resume(export, Path(args.since_checkpoint), pub, handle)
                older = [p for p in pending if p[1] < tree.size]
                pending[:] = [p for p in pending if p[1] >= tree.size]
                covered = tree.size
                checks.append(f"incremental: entries 0..{tree.size - 1} authenticated by the held checkpoint "
                              "(compact range from ranges.jsonl); only newer entries parsed")
                if older:
                    warnings.append(f"{len(older)} checkpoints older than the held one were not re-checked")
            add([])

            def check(batch: list) -> None:  # sequential: every entry, in order
                nonlocal prev
                leaves, seq, cur = [], tree.size, prev
                for raw in batch:
                    if not fast_ok(raw, seq, cur):
                        try:
                            exact_check(raw, seq, cur)
                        except Failure:
                            add(leaves)  # checkpoints before the bad entry are checked first
                            raise
                    cur = sha256(raw).hexdigest()
                    leaves.append(sha256(b"\x00" + raw).digest())
                    seq += 1
                prev = cur
                add(leaves)

            path = export / "entries.jsonl"
            size = path.stat().st_size
            workers = args.workers if args.workers is not None else default_workers(size)
            if workers > 1 and not args.since_checkpoint:
                # Byte ranges checked by worker processes (worker k of W: ranges k, k+W, ...), each
                # relative to its own first entry; chained here, in order, while this process hashes the
                # file. A range with any problem (or whose worker died) is re-checked sequentially (same
                # messages as above). Plain child processes of this script, streaming raw leaf hashes:
                # a multiprocessing pool would re-import __main__ per worker and pickle every hash.
                step = max(args.chunk_bytes, 1)
                ranges = [(str(path), lo, min(lo + step, size)) for lo in range(0, size, step)]
                workers = min(workers, len(ranges))
                cmd = [sys.executable, *(["-I"] if sys.flags.isolated else []), str(Path(__file__).resolve()),
                       "--chunk-worker", str(path), str(size), str(step)]
                procs = [subprocess.Popen([*cmd, str(k), str(workers)], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for k in range(workers)]
                dead: set = set()  # workers that broke off: their later ranges are re-checked here
                try:
                    for i, rng in enumerate(ranges):
                        got = None if i % workers in dead else read_chunk_result(procs[i % workers].stdout)
                        if got is None or not got[5] or got[1] != tree.size or got[2] != prev:
                            if got is None and i % workers not in dead:
                                dead.add(i % workers)
                                procs[i % workers].kill()
                            check(read_chunk_lines(*rng))
                        elif got[0]:
                            add(got[4])
                            prev = got[3]
                        digest.update(handle.read(rng[2] - rng[1]))
                finally:
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
                        proc.wait()
            else:
                for batch in line_batches(handle, digest):
                    check(batch)
        if pending:
            _, size, _, kind = pending[0]
            raise Failure(f"the log has {tree.size} entries but a {kind} checkpoint covers {size}: the tail was "
                          "removed", tree.size)
        if covered < tree.size:
            # An export always ends at a checkpoint that signs every entry in it (docs/audit-format.md),
            # so unsigned entries were appended afterwards - or the checkpoints were removed.
            raise Failure(f"entries {covered}..{tree.size - 1} are not covered by a signed checkpoint "
                          "(appended after the export, or its checkpoints were removed)", covered)
        if args.since_checkpoint:
            warnings.append("incremental: the manifest digest of entries.jsonl was not recomputed")
        elif digest.hexdigest() != manifest["files"]["entries.jsonl"]:
            raise Failure("entries.jsonl: SHA-256 does not match manifest.json")
        else:
            checks.append("manifest file digests match")
        checks.append(f"{tree.size} entries: canonical, densely numbered, hash chain intact")
        checks.append(f"Merkle roots (RFC 6962) match every checkpoint; root {tree.root().hex()}")
        check_latest(export, manifest, pub, tree.size, tree.root())
        checks.append("checkpoint.note and manifest.json name exactly this tree")
        result.update(ok=True, entries=tree.size, root_hash=tree.root().hex())
    except Failure as exc:
        result.update(error=str(exc), seq=exc.seq)
    except (OSError, KeyError, ValueError) as exc:
        result.update(error=f"cannot read export: {type(exc).__name__}: {exc}", io_error=True)
    return result


def resume(export: Path, held_path: Path, pub: Keys, handle) -> tuple[Tree, str]:  # noqa: ANN001
    """Tree and chain head at the held checkpoint, authenticated by its signed root.

    ranges.jsonl gives the compact range (peaks) at the held size: they must fold to the held root.
    The entries of the smallest peak are re-hashed (which authenticates the last one, whose hash
    the next entry chains to); the file handle is left at the first newer entry.
    """
    held = [open_checkpoint(n, pub, f"held checkpoint {held_path}") for n in split_notes(held_path.read_text(encoding="utf-8"))]
    if not held:
        raise Failure(f"{held_path} holds no checkpoint note")
    _, size, root = max(held, key=lambda c: c[1])
    tree = Tree()
    if size == 0:
        return tree, GENESIS
    record = None
    with open(export / "ranges.jsonl", "rb") as ranges:
        for line in ranges:
            item = json.loads(line)
            if isinstance(item, dict) and item.get("tree_size") == size:
                record = item
                break
    if record is None:
        raise Failure(f"the export has no compact range at the held checkpoint's size {size}")
    peaks = [bytes.fromhex(p) for p in record["peaks"]]
    if len(peaks) != bin(size).count("1") or any(len(p) != 32 for p in peaks):
        raise Failure(f"ranges.jsonl: malformed compact range for size {size}")
    tree.size, tree.peaks = size, peaks
    if tree.root() != root:
        raise Failure(f"the export's compact range at size {size} does not match the held checkpoint "
                      "(history before it was rewritten)")
    handle.seek(max(int(record["lowest_offset"]), 0))
    sub, last = Tree(), b""
    for _ in range(size & -size):
        line = handle.readline(MAX_LINE + 1)
        if not line.endswith(b"\n"):
            raise Failure(f"entries.jsonl ends or breaks before the held checkpoint's size {size}")
        last = line[:-1]
        sub.append(leaf_hash(last))
    if sub.root() != peaks[-1]:
        raise Failure(f"entries before {size} do not match the held checkpoint (history before it was rewritten)")
    return tree, hashlib.sha256(last).hexdigest()


def check_latest(export: Path, manifest: dict, pub: Keys, size: int, root: bytes) -> None:
    """checkpoint.note is the newest checkpoint and signs this tree; the manifest describes it."""
    latest = split_notes((export / "checkpoint.note").read_text(encoding="utf-8"))
    want_root = None
    if size or latest:
        if len(latest) != 1:
            raise Failure("checkpoint.note must hold exactly the newest checkpoint")
        _, cp_size, cp_root = open_checkpoint(latest[0], pub, "checkpoint.note")
        if cp_size != size or cp_root != root:
            raise Failure(f"checkpoint.note signs a tree of {cp_size} entries that is not the exported one ({size})")
        want_root = root.hex()
    if manifest.get("entries") != size or manifest.get("tree_size") != size or manifest.get("root_hash") != want_root:
        raise Failure(f"manifest.json entries/tree_size/root_hash do not describe the exported tree ({size} entries, "
                      f"root {root.hex()})")


def proof_handovers(proof: dict) -> tuple[list, list]:
    """The proof's hand-over notes and, per note, its consistency proof to the proven size (docs/audit-format.md)."""
    items = proof.get("handovers", [])  # absent in proofs made before key rotation existed
    if not isinstance(items, list) or any(
            not isinstance(h, dict) or not isinstance(h.get("note"), str) or not isinstance(h.get("consistency"), list)
            or not all(isinstance(x, str) for x in h["consistency"]) for h in items):
        raise Failure('the proof\'s handovers must be a list of {"note": <hand-over note>, "consistency": [hex...]}')
    return [h["note"] for h in items], [[bytes.fromhex(x) for x in h["consistency"]] for h in items]


def check_handover_links(points: list, links: list, origin: str, size: int, root: bytes) -> None:
    """The proven tree extends the tree each followed hand-over signs (what an export's entries show)."""
    for (ho_origin, m, ho_root), nodes in zip(points, links):
        if ho_origin != origin:
            raise Failure(f"the hand-over at size {m} is for log {ho_origin!r}, the checkpoint for {origin!r}")
        if m > size:
            raise Failure(f"the hand-over at size {m} lies beyond the proven tree of {size} entries")
        linked = (not nodes and ho_root == hashlib.sha256(b"").digest()) if m == 0 else \
            verify_consistency(m, size, nodes, ho_root, root)
        if not linked:
            raise Failure(f"the proven tree of {size} entries does not extend the tree of {m} entries the hand-over "
                          "signs (its consistency proof does not verify)")


def verify_proof(args: argparse.Namespace) -> dict:
    """Check the JSON printed by 'securetrain audit prove' (inclusion) or 'prove --consistency' against the key.

    The proof's checkpoint may be signed by a newer key: its ``handovers`` are followed from the
    trusted key(s) exactly as an export's handovers.notes, and each must link to the proven tree.
    """
    result = {"ok": False, "error": None, "seq": None, "warnings": [], "checks": [], "trusted": False,
              "entries": 0, "root_hash": None}
    try:
        proof = json.loads(Path(args.proof).read_text(encoding="utf-8"))
        notes, links = proof_handovers(proof)
        pub, result["trusted"] = load_keys(args, Path(args.export or "."), result["warnings"], notes,
                                           label="the proof's hand-over")
        nodes = [bytes.fromhex(h) for h in proof["proof"]]
        cp = open_checkpoint(proof["checkpoint"], pub, "the proof's checkpoint") if proof.get("checkpoint") else None
        if "old_size" in proof:  # consistency proof
            old, new = int(proof["old_size"]), int(proof["new_size"])
            old_root, new_root = bytes.fromhex(proof["old_root"]), bytes.fromhex(proof["new_root"])
            if not verify_consistency(old, new, nodes, old_root, new_root):
                raise Failure(f"consistency proof {old} -> {new} does not verify (the log was not append-only)")
            result["checks"].append(f"RFC 6962 consistency proof {old} -> {new} verifies")
            ends = ((old, old_root), (new, new_root))
            size, root = new, new_root
            proven = {"kind": "consistency", "old_size": old, "new_size": new}
            what = (f"verified that the tree of {old} entries is a prefix of the signed tree of {new} entries "
                    "(the log only grew)")
        else:
            entry = proof["entry"].encode()
            leaf, index, size, root = leaf_hash(entry), int(proof["leaf_index"]), int(proof["tree_size"]), bytes.fromhex(proof["root_hash"])
            if leaf.hex() != proof.get("leaf_hash", leaf.hex()):
                raise Failure("leaf_hash is not SHA-256(0x00 || entry)")
            if int(proof.get("seq", index)) != index or json.loads(entry).get("seq") != index:
                raise Failure("the entry's seq is not the proven leaf index")
            if not verify_inclusion(index, size, leaf, nodes, root):
                raise Failure(f"inclusion proof of entry {index} in a tree of {size} does not verify", index)
            result["checks"].append(f"RFC 6962 inclusion proof of entry {index} in a tree of {size} verifies")
            ends = ((size, root),)
            proven = {"kind": "inclusion", "leaf_index": index, "tree_size": size}
            what = f"verified that entry {index} is in the signed tree of {size} entries"
        # Every held checkpoint passed along is checked (signed by an accepted key, one of the proof's
        # ends), for inclusion proofs too: a trust input is never silently ignored.
        for path in args.trusted_checkpoint or []:
            for note in held_notes(path):
                _, held_size, held_root = open_checkpoint(note, pub, f"held checkpoint {path}")
                if (held_size, held_root) not in ends:
                    hint = ("" if "old_size" in proof else
                            f"; prove against it with 'securetrain audit prove {index} --size {held_size}', or "
                            f"that the log only grew since it with 'securetrain audit prove --consistency {held_size}'")
                    raise Failure(f"held checkpoint {path} (size {held_size}) is not an end of this proof{hint}")
                result["checks"].append(f"held checkpoint of size {held_size} is an end of the proof")
        if cp is None:
            raise Failure("the proof carries no signed checkpoint; pass one that signs its root")
        if cp[1] != size or cp[2] != root:
            raise Failure(f"the checkpoint signs a tree of {cp[1]} entries, not the proof's root")
        check_handover_links(pub.points, links, cp[0], size, root)
        if notes:
            result["checks"].append(f"{len(notes)} key hand-overs verify (signed by the old and the new key, starting "
                                    "from the trusted key); the proven tree extends the tree each one signs")
        result["checks"].append(f"the root is signed by the trusted key (checkpoint of size {size})")
        # A proof checks one entry's inclusion (or that the log only grew), not the entries of the tree.
        result.update(ok=True, entries=None, proof=proven, verified=what, root_hash=root.hex())
    except Failure as exc:
        result.update(error=str(exc), seq=exc.seq)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        result.update(error=f"cannot read the proof: {type(exc).__name__}: {exc}", io_error=True)
    return result


def write_html(result: dict, path: str) -> None:
    status = ("VERIFIED" if result["trusted"] else "SELF-CONSISTENT ONLY (UNTRUSTED KEY)") if result["ok"] else "FAILED"
    rows = "".join(f"<li>{html.escape(c)}</li>" for c in result["checks"])
    checked = f"Proof: {result['verified']}" if result.get("verified") else f"Entries: {result['entries']}"
    warn = "".join(f"<li>{html.escape(w)}</li>" for w in result["warnings"])
    err = "" if result["ok"] else f"<p class=bad>First problem (seq {result['seq']}): {html.escape(str(result['error']))}</p>"
    Path(path).write_text(
        f"<!doctype html><meta charset=utf-8><title>Audit verification: {status}</title>"
        "<style>body{font-family:sans-serif}.bad{color:#b00}.ok{color:#070}</style>"
        f"<h1 class={'ok' if result['ok'] else 'bad'}>Audit log {status}</h1>"
        f"<p>{html.escape(checked)}<br>Root: <code>{result['root_hash']}</code></p>{err}"
        f"<h2>Checks passed</h2><ul>{rows}</ul><h2>Warnings</h2><ul>{warn}</ul>", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--chunk-worker"]:  # a worker process started by verify() (see --workers)
        chunk_worker_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description="Verify a securetrain audit-log export offline.")
    parser.add_argument("export", nargs="?", help="directory written by 'securetrain audit export'")
    parser.add_argument("--proof", help="check a proof printed by 'securetrain audit prove' instead of an export")
    parser.add_argument("--vkey", action="append", help="trusted verifier key (name+id+base64) or a file holding it "
                        "(repeatable; later keys are reached through the export's handovers.notes)")
    parser.add_argument("--public-key", action="append", help="trusted Ed25519 public key (PEM; repeatable)")
    parser.add_argument("--trust-embedded-key", action="store_true",
                        help="accept the export's own public_key.pem (self-consistency only) and exit 0")
    parser.add_argument("--trusted-checkpoint", "--checkpoint", action="append",
                        help="checkpoint note you kept earlier, or an anchor file of them (repeatable; also "
                        "spelled --checkpoint, as in 'securetrain audit verify')")
    parser.add_argument("--since-checkpoint", help="incremental: a checkpoint note you hold from an earlier full "
                        "verification (or an anchor file: its newest note); only newer entries are parsed")
    parser.add_argument("--workers", type=int, help="processes checking entries (default: CPU count for "
                        "entries.jsonl of 8 MiB or more, else 1)")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20, help=argparse.SUPPRESS)  # tests: tiny ranges
    parser.add_argument("--html", help="also write an HTML report here")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if not args.export and not args.proof:
        parser.error("give an export directory or --proof FILE")
    if args.proof and not (args.vkey or args.public_key):
        parser.error("--proof needs the key you hold: --vkey or --public-key")
    result = verify_proof(args) if args.proof else verify(args)
    if args.html:
        write_html(result, args.html)
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["ok"]:
        what = "OK" if result["trusted"] else "SELF-CONSISTENT (UNTRUSTED KEY)"
        checked = result.get("verified") or f"{result['entries']} entries verified"  # a proof says what it checked
        print(f"{what}: {checked}, root {result['root_hash']}")
        for w in result["warnings"]:
            print(f"warning: {w}")
    else:
        where = f"entry seq={result['seq']}: " if result["seq"] is not None else ""
        print(f"FAILED: {where}{result['error']}", file=sys.stderr)
    if result["ok"]:
        if result["trusted"] or args.trust_embedded_key:
            return 0
        print("UNTRUSTED: verified only against the public key shipped inside the export; a forger re-signs with "
              "their own key. Pass --vkey/--public-key with the key you hold (or --trust-embedded-key).", file=sys.stderr)
        return 3
    return 2 if result.get("io_error") else 1


if __name__ == "__main__":
    sys.exit(main())

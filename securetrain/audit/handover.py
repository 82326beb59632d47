"""Audit-key rotation: the signed hand-over note, and the key chain verifiers follow.

A hand-over is a C2SP signed note whose body is exactly (``\\n`` = one LF byte)::

    securetrain.audit/key-handover/v1\\n
    <origin>\\n
    <tree size, decimal, no leading zeros>\\n
    <base64 of the 32-byte root hash at that size>\\n
    old <verifier key of the retiring key>\\n
    new <verifier key of the new key>\\n

signed by the old key *and* by the new key (proof of possession), in that order. From the hand-over
size on, checkpoints are signed by the new key; the old key is retired (checkpoints it signs at a
larger size are refused). A verifier starts from the keys the auditor trusts and accepts a key only
through a hand-over signed by an already accepted key (see docs/audit-format.md, "Key rotation").
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from securetrain.audit.errors import AuditConfigError, AuditIntegrityError
from securetrain.audit.note import (
    EM_DASH,
    Checkpoint,
    key_id,
    parse_checkpoint_text,
    parse_note,
    parse_verifier_key,
    raw_public_key,
    sign_note,
    verifier_key,
)
from securetrain.audit.signers import CheckpointSigner

HANDOVER_HEADER = "securetrain.audit/key-handover/v1"
#: ``action`` of the audit entry that records a hand-over (its details hold the note).
ROTATION_ACTION = "audit.key_rotated"
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,15}")


@dataclass(frozen=True)
class Handover:
    origin: str
    tree_size: int
    root_hash: bytes
    old_vkey: str
    new_vkey: str
    old_key: Ed25519PublicKey
    new_key: Ed25519PublicKey
    note: str = ""

    @property
    def old_raw(self) -> bytes:
        return raw_public_key(self.old_key)

    @property
    def new_raw(self) -> bytes:
        return raw_public_key(self.new_key)


@dataclass(frozen=True)
class HandoverPoint(Checkpoint):
    """A hand-over's (size, root), met by the verifier like a checkpoint: the tree must match it."""


def handover_body(origin: str, tree_size: int, root: bytes, old_vkey: str, new_vkey: str) -> str:
    if not origin or "\n" in origin or tree_size < 0 or len(root) != 32:
        raise ValueError("bad hand-over origin, tree size or root")
    return (f"{HANDOVER_HEADER}\n{origin}\n{tree_size}\n{base64.b64encode(root).decode()}\n"
            f"old {old_vkey}\nnew {new_vkey}\n")


def sign_handover(origin: str, tree_size: int, root: bytes, *, old_name: str,
                  old_key: Ed25519PrivateKey | CheckpointSigner, new_name: str,
                  new_key: Ed25519PrivateKey | CheckpointSigner) -> str:
    """The hand-over note: the body signed by the old key, then by the new key."""
    old_pub, new_pub = old_key.public_key(), new_key.public_key()
    if raw_public_key(old_pub) == raw_public_key(new_pub):
        raise AuditConfigError("the new audit key is the same key as the current one: a rotation needs a different key",
                               hint="create one with 'securetrain audit keygen --out NEW.pem'")
    body = handover_body(origin, tree_size, root, verifier_key(old_name, old_pub), verifier_key(new_name, new_pub))
    note = sign_note(body, old_name, old_key)
    blob = key_id(new_name, new_pub) + new_key.sign(body.encode())
    return f"{note}{EM_DASH} {new_name} {base64.b64encode(blob).decode()}\n"


def _bad(message: str, problem: str = "handover-malformed") -> AuditIntegrityError:
    return AuditIntegrityError(message, problem=problem)


def parse_handover(note: str) -> tuple[str, Handover]:
    """Parse (not verify) a hand-over note: its text and the statement."""
    text, _ = parse_note(note)
    lines = text.split("\n")
    if len(lines) != 7 or lines[0] != HANDOVER_HEADER or lines[6] != "":
        raise _bad(f"not a {HANDOVER_HEADER} note (header, origin, size, root, old key, new key)")
    origin, size_s, root_s, old_line, new_line = lines[1:6]
    if not origin or not _DECIMAL.fullmatch(size_s):
        raise _bad("hand-over origin is empty or its tree size is not a decimal")
    try:
        root = base64.b64decode(root_s, validate=True)
    except binascii.Error:
        root = b""
    if len(root) != 32 or not old_line.startswith("old ") or not new_line.startswith("new "):
        raise _bad("hand-over root is not a base64 SHA-256 hash, or the old/new key lines are malformed")
    try:
        old_vkey, new_vkey = old_line[4:], new_line[4:]
        old_key, new_key = parse_verifier_key(old_vkey)[1], parse_verifier_key(new_vkey)[1]
    except ValueError as exc:
        raise _bad(f"hand-over key line: {exc}") from None
    return text, Handover(origin, int(size_s), root, old_vkey, new_vkey, old_key, new_key, note)


def _signed_by(note: str, text: str, vkey: str) -> bool:
    """True if a signature line by ``vkey`` verifies; False if there is none; raise if one fails."""
    name, pub = parse_verifier_key(vkey)
    want = key_id(name, pub)
    found = False
    for sig in parse_note(note)[1]:
        if sig.name == name and sig.key_id == want:
            try:
                pub.verify(sig.signature, text.encode())
            except InvalidSignature:
                raise _bad(f"hand-over signature by {name} ({want.hex()}) does not verify: forged or altered",
                           "handover-bad-signature") from None
            found = True
    return found


def open_handover(note: str) -> Handover:
    """Parse a hand-over and check both signatures (old key: authority, new key: possession)."""
    text, ho = parse_handover(note)
    if ho.old_raw == ho.new_raw:
        raise _bad(f"hand-over at size {ho.tree_size} rotates to the same key", "handover-same-key")
    if not _signed_by(note, text, ho.old_vkey):
        raise _bad(f"hand-over at size {ho.tree_size} is not signed by the old key {ho.old_vkey.split('+')[0]}: "
                   "only the retiring key can authorise a new one", "handover-unsigned")
    if not _signed_by(note, text, ho.new_vkey):
        raise _bad(f"hand-over at size {ho.tree_size} is not signed by the new key (no proof of possession)",
                   "handover-unsigned")
    return ho


@dataclass
class KeyWindow:
    """An accepted key: it may sign checkpoints of sizes ``start`` .. ``end`` (``None``: no end yet)."""

    key: Ed25519PublicKey
    start: int = 0
    end: int | None = None
    pinned: bool = True


@dataclass
class KeyChain:
    """The keys a verifier accepts, each with the tree sizes it may sign."""

    windows: dict[bytes, KeyWindow] = field(default_factory=dict)
    handovers: list[Handover] = field(default_factory=list)

    def points(self) -> list[HandoverPoint]:
        return [HandoverPoint(h.origin, h.tree_size, h.root_hash, h.note) for h in self.handovers]


def build_chain(trusted: Iterable[Ed25519PublicKey], handover_notes: Sequence[str]) -> KeyChain:
    """Follow the hand-overs (ascending size) from the trusted keys; raise on any that does not link."""
    chain = KeyChain({raw_public_key(k): KeyWindow(k) for k in trusted})
    last = 0
    for note in handover_notes:
        ho = open_handover(note)
        old = chain.windows.get(ho.old_raw)
        where = f"hand-over at size {ho.tree_size}"
        if old is None:
            raise _bad(f"{where} comes from a key that is neither trusted nor handed over to (a hand-over "
                       "must be signed by an already accepted key; pass the key you trusted before the rotation "
                       "too: --public-key may be repeated)", "handover-untrusted")
        if old.end is not None:
            raise _bad(f"{where}: the old key was already retired at size {old.end} (a second hand-over from a "
                       "retired key)", "key-retired")
        if ho.tree_size < max(last, old.start):
            raise _bad(f"{where} precedes an earlier hand-over or the old key's own start", "handover-order")
        new = chain.windows.get(ho.new_raw)
        if new is not None and (not new.pinned or new.end is not None):
            raise _bad(f"{where} rotates to a key that was already in use", "handover-reused-key")
        old.end = ho.tree_size
        if new is not None:
            new.start = ho.tree_size  # pinned too: the hand-over says from when it signs
        else:
            chain.windows[ho.new_raw] = KeyWindow(ho.new_key, ho.tree_size, None, pinned=False)
        chain.handovers.append(ho)
        last = ho.tree_size
    return chain


def root_key(own: Ed25519PublicKey, handover_notes: Sequence[str]) -> Ed25519PublicKey:
    """The first key of the hand-over chain that ends at ``own`` (walked backwards; ``own`` if none).

    For verifying with the log's own (or the export's embedded) key: every step is signed by the
    key it leads to, so it is only as trusted as ``own`` itself.
    """
    current, seen = own, {raw_public_key(own)}
    valid = []
    for note in handover_notes:
        try:
            valid.append(open_handover(note))
        except AuditIntegrityError:
            continue
    for ho in reversed(valid):
        if ho.new_raw == raw_public_key(current) and ho.old_raw not in seen:
            current = ho.old_key
            seen.add(ho.old_raw)
    return current


def open_with_chain(note: str, chain: KeyChain) -> tuple[str, int, bytes]:
    """Verify a checkpoint note against the chain: signed by an accepted key within its window."""
    text, sigs = parse_note(note)
    matched: list[KeyWindow] = []
    for sig in sigs:
        for window in chain.windows.values():
            if sig.key_id != key_id(sig.name, window.key):
                continue
            try:
                window.key.verify(sig.signature, text.encode())
            except InvalidSignature:
                raise AuditIntegrityError(f"note signature by {sig.name} does not verify",
                                          problem="note-bad-signature") from None
            matched.append(window)
    if not matched:
        raise AuditIntegrityError("checkpoint is not signed by the trusted key (nor by a key a hand-over leads to)",
                                  problem="note-unknown-key",
                                  hint="pass the log's public key you hold; after a rotation, the export's "
                                  "handovers.notes links the old key to the new one")
    origin, size, root = parse_checkpoint_text(text)
    for window in matched:
        if window.start <= size and (window.end is None or size <= window.end):
            return origin, size, root
    window = matched[0]
    if window.end is not None and size > window.end:
        raise AuditIntegrityError(f"checkpoint of size {size} is signed by a key retired at hand-over size "
                                  f"{window.end}", problem="key-retired")
    raise AuditIntegrityError(f"checkpoint of size {size} is signed by a key that took over only at size "
                              f"{window.start}", problem="key-not-yet-valid")


def handover_note_of(details: object) -> str | None:
    """The hand-over note held by an ``audit.key_rotated`` entry's details, if any."""
    note = details.get("note") if isinstance(details, dict) else None
    return note if isinstance(note, str) else None


def writer_chain(own: Ed25519PublicKey, handover_notes: Sequence[str]) -> tuple[KeyChain, Handover | None]:
    """For a writer holding ``own``: the chain from the first key to ``own`` (invalid hand-overs are
    skipped: only notes signed by the keys themselves count), and the hand-over that retired ``own``
    if there is one (then the writer must not sign any more)."""
    valid: list[Handover] = []
    for note in handover_notes:
        try:
            valid.append(open_handover(note))
        except AuditIntegrityError:
            continue
    own_raw = raw_public_key(own)
    retired = next((h for h in valid if h.old_raw == own_raw), None)
    path: list[Handover] = []
    current, seen = own_raw, {own_raw}
    for ho in reversed(valid):
        if ho.new_raw == current and ho.old_raw not in seen:
            path.append(ho)
            current = ho.old_raw
            seen.add(current)
    first = path[-1].old_key if path else own
    try:
        chain = build_chain([first], [h.note for h in reversed(path)])
    except AuditIntegrityError:
        chain = build_chain([own], [])
    return chain, retired

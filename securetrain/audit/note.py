"""C2SP signed notes (c2sp.org/signed-note) and checkpoints (c2sp.org/tlog-checkpoint), Ed25519.

A checkpoint note is::

    <origin>\n<tree size>\n<base64 root hash>\n
    \n
    — <key name> <base64(key ID || Ed25519 signature over the body)>\n

with ``key ID = SHA-256(key name || 0x0A || 0x01 || 32-byte public key)[:4]``. Verifier keys use the
Go ``golang.org/x/mod/sumdb/note`` text form ``<name>+<hex key ID>+<base64(0x01 || public key)>``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from securetrain.audit.errors import AuditIntegrityError
from securetrain.audit.signers import CheckpointSigner

ALG_ED25519 = 0x01
EM_DASH = "\u2014"
_BAD_NAME = re.compile(r"[\s+]")
MAX_NOTE_BYTES = 64 * 1024


def raw_public_key(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def check_key_name(name: str) -> str:
    if not name or _BAD_NAME.search(name):
        raise ValueError(f"note key name {name!r} must be non-empty without spaces or '+'")
    return name


def key_id(name: str, public_key: Ed25519PublicKey) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([ALG_ED25519]) + raw_public_key(public_key)).digest()[:4]


def verifier_key(name: str, public_key: Ed25519PublicKey) -> str:
    """``name+hexid+base64(0x01||pub)``, the note verifier-key text form."""
    check_key_name(name)
    raw = bytes([ALG_ED25519]) + raw_public_key(public_key)
    return f"{name}+{key_id(name, public_key).hex()}+{base64.b64encode(raw).decode()}"


def parse_verifier_key(vkey: str) -> tuple[str, Ed25519PublicKey]:
    parts = vkey.strip().split("+", 2)  # base64 may itself contain "+"
    if len(parts) != 3:
        raise ValueError("verifier key must look like name+hexid+base64key")
    name, hex_id, b64 = parts
    try:
        raw = base64.b64decode(b64, validate=True)
        want_id = bytes.fromhex(hex_id)
    except (binascii.Error, ValueError):
        raise ValueError("verifier key has bad hex or base64") from None
    if len(raw) != 33 or raw[0] != ALG_ED25519:
        raise ValueError("verifier key is not an Ed25519 (type 0x01) key")
    pub = Ed25519PublicKey.from_public_bytes(raw[1:])
    if key_id(check_key_name(name), pub) != want_id:
        raise ValueError("verifier key id does not match its name and public key")
    return name, pub


@dataclass(frozen=True)
class Signature:
    name: str
    key_id: bytes
    signature: bytes


def sign_note(text: str, name: str, private_key: Ed25519PrivateKey | CheckpointSigner) -> str:
    if not text.endswith("\n"):
        raise ValueError("note text must end with a newline")
    check_key_name(name)
    sig = private_key.sign(text.encode())
    blob = key_id(name, private_key.public_key()) + sig
    return f"{text}\n{EM_DASH} {name} {base64.b64encode(blob).decode()}\n"


def parse_note(note: str) -> tuple[str, list[Signature]]:
    """Split a signed note into its text and signature lines (no verification)."""
    if len(note.encode()) > MAX_NOTE_BYTES:
        raise AuditIntegrityError("signed note is too large", problem="note-malformed")
    if any(ord(c) < 0x20 and c != "\n" for c in note):
        raise AuditIntegrityError("signed note contains control characters", problem="note-malformed")
    if not note.endswith("\n"):
        raise AuditIntegrityError("signed note does not end with a newline", problem="note-malformed")
    split = note.rfind("\n\n")
    if split < 0:
        raise AuditIntegrityError("signed note has no blank line before its signatures", problem="note-malformed")
    text, sig_block = note[: split + 1], note[split + 2 :]
    sigs: list[Signature] = []
    for line in sig_block.splitlines():
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != EM_DASH or not parts[1]:
            raise AuditIntegrityError(f"malformed signature line {line[:40]!r}", problem="note-malformed")
        try:
            blob = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            raise AuditIntegrityError("signature line is not base64", problem="note-malformed") from None
        if len(blob) < 5:
            raise AuditIntegrityError("signature too short", problem="note-malformed")
        sigs.append(Signature(parts[1], blob[:4], blob[4:]))
    if not sigs:
        raise AuditIntegrityError("signed note has no signatures", problem="note-malformed")
    return text, sigs


def verify_note(note: str, name: str, public_key: Ed25519PublicKey) -> str:
    """Return the note text if a signature by (name, key) verifies; raise otherwise.

    Per the spec, signatures by unknown keys are ignored, and a failing known signature rejects the note.
    """
    text, sigs = parse_note(note)
    want = key_id(name, public_key)
    known = [s for s in sigs if s.name == name and s.key_id == want]
    if not known:
        raise AuditIntegrityError(f"note is not signed by the trusted key {name}", problem="note-unknown-key",
                                  hint="check that you pass the log's public key")
    for sig in known:
        try:
            public_key.verify(sig.signature, text.encode())
        except InvalidSignature:
            raise AuditIntegrityError(f"note signature by {name} does not verify", problem="note-bad-signature") from None
    return text


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    tree_size: int
    root_hash: bytes
    note: str = ""

    def body(self) -> str:
        return checkpoint_body(self.origin, self.tree_size, self.root_hash)


def checkpoint_body(origin: str, tree_size: int, root: bytes) -> str:
    if not origin or "\n" in origin:
        raise ValueError("checkpoint origin must be one non-empty line")
    if tree_size < 0 or len(root) != 32:
        raise ValueError("bad tree size or root hash")
    return f"{origin}\n{tree_size}\n{base64.b64encode(root).decode()}\n"


def parse_checkpoint_text(text: str) -> tuple[str, int, bytes]:
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "" or any(not line for line in lines[:-1]):
        raise AuditIntegrityError("checkpoint text must be origin, size, root lines", problem="checkpoint-malformed")
    origin, size_s, root_s = lines[0], lines[1], lines[2]
    if not re.fullmatch(r"0|[1-9][0-9]*", size_s):
        raise AuditIntegrityError(f"checkpoint tree size {size_s[:20]!r} is not a decimal", problem="checkpoint-malformed")
    try:
        root = base64.b64decode(root_s, validate=True)
    except binascii.Error:
        root = b""
    if len(root) != 32:
        raise AuditIntegrityError("checkpoint root is not a base64 SHA-256 hash", problem="checkpoint-malformed")
    return origin, int(size_s), root


def sign_checkpoint(origin: str, tree_size: int, root: bytes, name: str,
                    key: Ed25519PrivateKey | CheckpointSigner) -> Checkpoint:
    body = checkpoint_body(origin, tree_size, root)
    return Checkpoint(origin, tree_size, root, sign_note(body, name, key))


def open_checkpoint(note: str, name: str, public_key: Ed25519PublicKey, *, origin: str | None = None) -> Checkpoint:
    """Verify a checkpoint note's signature and parse it."""
    text = verify_note(note, name, public_key)
    got_origin, size, root = parse_checkpoint_text(text)
    if origin is not None and got_origin != origin:
        raise AuditIntegrityError(f"checkpoint origin {got_origin!r} is not this log ({origin!r})", problem="checkpoint-origin")
    return Checkpoint(got_origin, size, root, note)


def split_notes(blob: str) -> list[str]:
    """Split concatenated signed notes (as an anchor file holds them) into single notes."""
    notes: list[str] = []
    current: list[str] = []
    in_sigs = False
    for line in blob.splitlines(keepends=True):
        if in_sigs and not line.startswith(EM_DASH + " "):
            notes.append("".join(current))
            current, in_sigs = [], False
        current.append(line)
        if line == "\n":
            in_sigs = True
    if current:
        notes.append("".join(current))
    return [n for n in notes if n.strip()]


def find_signer(note: str, public_key: Ed25519PublicKey) -> str:
    """Key name of the signature line made with ``public_key`` (any name); raise if none verifies."""
    _, sigs = parse_note(note)
    for sig in sigs:
        if sig.key_id == key_id(sig.name, public_key):
            verify_note(note, sig.name, public_key)
            return sig.name
    raise AuditIntegrityError("note carries no signature by the trusted public key", problem="note-unknown-key",
                              hint="the log was re-signed with another key, or you hold the wrong public key")

"""Full verification of an audit log (from the database or an export).

Checks, in order, for every entry: dense ``seq`` from 0, known format version and field types,
canonical encoding, ``prev_hash`` linking to the previous entry's hash, the stored ``entry_hash``
(when there is one). Then every checkpoint — the log's own and the ones the auditor trusts — must
carry a valid Ed25519 signature by the trusted key, and its root must equal the Merkle root of the
first ``tree_size`` entries. A checkpoint larger than the log means the tail was removed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from securetrain.audit.canonical import FORMAT_VERSION, GENESIS_HASH, HASHED_FIELDS, canonical_bytes, sha256_hex
from securetrain.audit.errors import AuditEventError, AuditIntegrityError
from securetrain.audit.merkle import CompactRange, leaf_hash
from securetrain.audit.note import Checkpoint, find_signer, parse_checkpoint_text, verify_note

_STR_FIELDS = ("ts", "actor", "hostname", "mac", "action", "resource", "outcome", "prev_hash")


@dataclass
class VerifyReport:
    ok: bool
    entries: int
    root_hash: str
    checkpoints_verified: int = 0
    trusted_verified: int = 0
    latest_checkpoint_size: int | None = None
    error: AuditIntegrityError | None = None
    warnings: list[str] = field(default_factory=list)

    def raise_for_failure(self) -> None:
        if self.error is not None:
            raise self.error

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "entries": self.entries, "root_hash": self.root_hash,
            "checkpoints_verified": self.checkpoints_verified, "trusted_verified": self.trusted_verified,
            "latest_checkpoint_size": self.latest_checkpoint_size,
            "error": None if self.error is None else {"seq": self.error.seq, "problem": self.error.problem, "message": str(self.error)},
            "warnings": self.warnings,
        }


def _fail(seq: int | None, problem: str, message: str) -> AuditIntegrityError:
    where = f"entry seq={seq}: " if seq is not None else ""
    return AuditIntegrityError(where + message, seq=seq, problem=problem)


def check_object(obj: Any, seq: int) -> None:
    """Structural checks of one hashed object (types, version, no floats)."""
    if not isinstance(obj, dict) or set(obj) != set(HASHED_FIELDS):
        raise _fail(seq, "fields", f"entry must have exactly the fields {sorted(HASHED_FIELDS)}")
    if obj["v"] != FORMAT_VERSION or type(obj["v"]) is not int:
        raise _fail(seq, "version", f"unknown format version {obj['v']!r}")
    if type(obj["seq"]) is not int:
        raise _fail(seq, "seq", "seq is not an integer")
    for name in _STR_FIELDS:
        if not isinstance(obj[name], str):
            raise _fail(seq, name, f"{name} is not a string")
    if not isinstance(obj["details"], dict):
        raise _fail(seq, "details", "details is not an object")
    if _has_float(obj["details"]):
        raise _fail(seq, "details", "details contain a float, which the format forbids")


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return False


@dataclass
class Record:
    """One entry as the verifier sees it: the hashed bytes, parsed, and the stored hash if any."""

    raw: bytes
    obj: Any
    stored_hash: str | None = None
    stored_seq: int | None = None


def verify_records(
    records: Iterable[Record],
    *,
    public_key: Ed25519PublicKey | None,
    checkpoint_notes: Iterable[str] = (),
    trusted_notes: Iterable[str] = (),
    on_entry: Callable[[int], None] | None = None,
    require_signed: bool = False,
) -> VerifyReport:
    """Verify a stream of entries against checkpoints. Never raises for integrity problems.

    ``require_signed=True`` (exports: they always end at a checkpoint) fails when entries follow the
    newest checkpoint; otherwise (a live database) they are reported as a warning.
    """
    cr = CompactRange()
    prev = GENESIS_HASH
    try:
        own = [_open(n, public_key, trusted=False) for n in checkpoint_notes]
        trusted = [_open(n, public_key, trusted=True) for n in trusted_notes]
    except AuditIntegrityError as exc:
        return VerifyReport(False, 0, cr.root().hex(), error=exc)
    pending = sorted(own + trusted, key=lambda item: item[0].tree_size)
    report = VerifyReport(True, 0, cr.root().hex())
    if own:
        report.latest_checkpoint_size = max(c.tree_size for c, _ in own)
    if public_key is None and (own or trusted):
        report.warnings.append("no trusted public key given: checkpoint signatures were checked only for form")

    def check_pending() -> None:
        while pending and pending[0][0].tree_size == cr.size:
            cp, is_trusted = pending.pop(0)
            if cp.root_hash != cr.root():
                kind = "trusted" if is_trusted else "stored"
                raise _fail(cr.size - 1 if cr.size else None, "checkpoint-root",
                            f"Merkle root of the first {cp.tree_size} entries does not match the {kind} checkpoint "
                            "(history before it was rewritten)")
            if is_trusted:
                report.trusted_verified += 1
            else:
                report.checkpoints_verified += 1

    try:
        check_pending()
        for expected, rec in enumerate(records):
            seq = expected
            if rec.stored_seq is not None and rec.stored_seq != expected:
                raise _fail(expected, "seq-gap", f"expected seq {expected}, found row with seq {rec.stored_seq} "
                                                 "(an entry was deleted, inserted or reordered)")
            check_object(rec.obj, seq)
            if rec.obj["seq"] != expected:
                raise _fail(expected, "seq", f"entry claims seq {rec.obj['seq']}, expected {expected}")
            try:
                canonical = canonical_bytes(rec.obj)
            except AuditEventError:  # e.g. an integer beyond 2^53 or a lone surrogate: tampered data
                raise _fail(seq, "canonical", "entry holds a value with no RFC 8785 canonical form "
                                              "(integer outside ±(2^53-1) or lone surrogate)") from None
            if canonical != rec.raw:
                raise _fail(seq, "canonical", "entry bytes are not RFC 8785 canonical JSON")
            if rec.obj["prev_hash"] != prev:
                raise _fail(seq, "prev_hash", "prev_hash does not match the previous entry's hash "
                                              "(this or the previous entry was altered, or entries were removed)")
            digest = sha256_hex(rec.raw)
            if rec.stored_hash is not None and rec.stored_hash != digest:
                raise _fail(seq, "entry_hash", "stored entry_hash does not match the entry's content")
            prev = digest
            cr.append(leaf_hash(rec.raw))
            report.entries = cr.size
            check_pending()
            if on_entry is not None:
                on_entry(cr.size)
        covered = max([c.tree_size for c, _ in own + trusted], default=0)
        if require_signed and not pending and covered < cr.size:
            raise _fail(covered, "unsigned", f"entries {covered}..{cr.size - 1} are not covered by a signed "
                                             "checkpoint (appended after the export, or its checkpoints were removed)")
        if pending:
            cp, is_trusted = pending[0]
            raise _fail(cr.size, "truncated", f"log has {cr.size} entries but a {'trusted' if is_trusted else 'stored'} "
                                              f"checkpoint covers {cp.tree_size}: the tail was removed")
    except AuditIntegrityError as exc:
        # Drop the traceback: it would keep the records generator (and its DB transaction) alive.
        report.ok, report.error = False, exc.with_traceback(None)
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()  # release the reader's connection/transaction now, not at garbage collection
    report.root_hash = cr.root().hex()
    latest = report.latest_checkpoint_size
    if report.ok and (latest is None or latest < cr.size):
        uncovered = cr.size - (latest or 0)
        report.warnings.append(f"{uncovered} newest entries are not yet covered by a signed checkpoint")
    return report


def _open(note: str, public_key: Ed25519PublicKey | None, *, trusted: bool) -> tuple[Checkpoint, bool]:
    if public_key is not None:
        name = find_signer(note, public_key)
        text = verify_note(note, name, public_key)
    else:
        from securetrain.audit.note import parse_note

        text, _ = parse_note(note)
    origin, size, root = parse_checkpoint_text(text)
    return Checkpoint(origin, size, root, note), trusted


def records_from_jsonl(lines: Iterable[bytes]) -> Iterable[Record]:
    """Records from an export's ``entries.jsonl`` (each line: the exact hashed bytes)."""
    for number, line in enumerate(lines):
        raw = line[:-1] if line.endswith(b"\n") else line
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _fail(number, "json", "line is not valid JSON") from None
        yield Record(raw, obj)

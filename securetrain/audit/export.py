"""Self-contained export an auditor verifies offline with ``audit/verify_audit.py``.

Files: ``entries.jsonl`` (one line per entry: exactly the hashed bytes), ``checkpoints.note`` (all
signed checkpoints, concatenated, oldest first), ``checkpoint.note`` (the latest), ``public_key.pem``,
``verifier_key.txt``, ``ranges.jsonl`` (the Merkle compact range at every checkpoint size, for
incremental verification from a held checkpoint), ``handovers.notes`` (the signed key hand-over notes,
concatenated, ascending size; empty when the key was never rotated), and ``manifest.json`` with the
SHA-256 of every other file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from securetrain.cpus import usable_cpus
from securetrain.audit.merkle import CompactRange, leaf_hash
from securetrain.io.atomic import atomic_write_bytes, atomic_writer

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from securetrain.audit.log import AuditLog
    from securetrain.audit.verify import VerifyReport

EXPORT_FORMAT = "securetrain-audit-export"
EXPORT_VERSION = 1


def _range_line(tree: CompactRange, lowest_offset: int) -> bytes:
    """One line of ``ranges.jsonl``: the compact range of the tree at a checkpoint size.

    ``peaks`` are the roots of the perfect subtrees that make up the first ``tree_size`` leaves,
    largest (leftmost) first; folding them right to left gives the checkpoint's root, which is how a
    verifier authenticates them. ``lowest_offset`` is the byte offset in ``entries.jsonl`` of the
    first leaf of the smallest peak (line ``tree_size - 2**ctz(tree_size)``).
    """
    return (json.dumps({"tree_size": tree.size, "peaks": [p.hex() for p in tree.peaks()],
                        "lowest_offset": lowest_offset}, sort_keys=True, separators=(",", ":")) + "\n").encode()


def export_log(log: AuditLog, outdir: str | os.PathLike[str], *, checkpoint: bool = True) -> Path:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint:
        log.checkpoint()
    cps = log.checkpoints()
    latest = cps[-1] if cps else None
    stop = latest.tree_size if latest else None  # export exactly what the latest checkpoint signs
    hashes: dict[str, str] = {}
    digest = hashlib.sha256()
    count = offset = 0
    tree = CompactRange()
    sizes = {c.tree_size for c in cps if c.tree_size > 0}
    offsets: dict[int, int] = {}  # line number -> byte offset, for the lines ranges.jsonl points at
    wanted = {size - (size & -size) for size in sizes}
    ranges: list[bytes] = []
    with atomic_writer(out / "entries.jsonl", mode=0o600) as handle:
        for entry in log.entries(0, stop):
            raw = entry.hashed_bytes()
            if count in wanted:
                offsets[count] = offset
            handle.write(raw + b"\n")
            digest.update(raw + b"\n")
            offset += len(raw) + 1
            count += 1
            tree.append(leaf_hash(raw))
            if count in sizes:
                ranges.append(_range_line(tree, offsets[count - (count & -count)]))
    hashes["entries.jsonl"] = digest.hexdigest()
    handovers = log.handover_notes(count)
    files = {
        "ranges.jsonl": b"".join(ranges),
        "checkpoints.note": "".join(c.note for c in cps).encode(),
        "checkpoint.note": (latest.note if latest else "").encode(),
        "handovers.notes": "".join(handovers).encode(),
        "public_key.pem": log.public_key_pem(),
        "verifier_key.txt": (log.verifier_key() + "\n").encode(),
    }
    for name, data in files.items():
        atomic_write_bytes(out / name, data, mode=0o644 if name in ("public_key.pem", "verifier_key.txt") else 0o600)
        hashes[name] = hashlib.sha256(data).hexdigest()
    manifest = {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "origin": log.origin, "entries": count,
        "tree_size": latest.tree_size if latest else 0,
        "root_hash": latest.root_hash.hex() if latest else None, "files": hashes,
    }
    atomic_write_bytes(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n", mode=0o600)
    return out


#: ``entries.jsonl`` at least this large is checked by several processes (``workers=None``): below
#: it (about 20,000 entries) starting them (~0.1 s each) costs more than they save.
PARALLEL_MIN_BYTES = 8 << 20


def default_workers(entries_bytes: int) -> int:
    """Worker processes for ``workers=None``: 1 below :data:`PARALLEL_MIN_BYTES`, else the usable CPUs (at most 8)."""
    if entries_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(usable_cpus(), 8))

#: Files every export has; a missing one is an error, not a failed verification.
REQUIRED_FILES = ("manifest.json", "entries.jsonl", "checkpoints.note", "checkpoint.note")


def _read_text(path: Path) -> str:
    from securetrain.audit.errors import AuditExportError

    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AuditExportError(f"the export has no {path.name} ({path})",
                               hint="pass the directory written by 'securetrain audit export', complete") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditExportError(f"cannot read {path}: {type(exc).__name__}") from None


def verify_export(
    outdir: str | os.PathLike[str],
    *,
    public_key: Ed25519PublicKey | Sequence[Ed25519PublicKey] | None = None,
    trusted_notes: Sequence[str] = (),
    on_entry: Callable[[int], None] | None = None,
    since_checkpoint: str | None = None,
    workers: int | None = None,
    chunk_bytes: int | None = None,
) -> VerifyReport:
    """Verify an export directory, streaming ``entries.jsonl`` (memory independent of its length).

    ``since_checkpoint`` (a checkpoint note the auditor holds from an earlier full verification, or
    an anchor file: its newest note is used) makes the verification incremental: the compact range
    at the held size (``ranges.jsonl``) is authenticated against the held root, the entries of its
    smallest subtree are re-hashed to recover the chain head, and only newer entries are checked.
    ``workers`` processes check entries in parallel (default: :func:`default_workers`); results and
    messages are the same as a sequential run's.

    ``public_key`` is the key the auditor holds (or several). After a key rotation the export's
    ``handovers.notes`` links each key to the next; checkpoints by keys reached that way are accepted
    within their hand-over sizes only (see :mod:`securetrain.audit.handover`). Without it the export's own ``public_key.pem`` is
    used and the report's ``key_source`` is ``"embedded"``: that proves only that the export is
    self-consistent (anyone can rebuild and re-sign a forged export with a fresh key), so callers
    must not present it as verified. Besides every entry and checkpoint, checks the manifest's file
    digests, ``entries``/``tree_size``/``root_hash``, and that ``checkpoint.note`` is the newest
    checkpoint and signs exactly the exported tree.

    Raises :class:`~securetrain.audit.errors.AuditExportError` for a missing or unreadable file;
    every integrity problem is reported in the returned report instead.
    """
    from securetrain.audit.errors import AuditExportError, AuditIntegrityError
    from securetrain.audit.keys import load_public_key_pem
    from securetrain.audit.note import split_notes
    from securetrain.audit.handover import root_key
    from securetrain.audit.verify import (
        PARALLEL_CHUNK_BYTES,
        VerifyReport,
        open_checkpoint_note,
        iter_line_batches,
        key_chain,
        verify_file_parallel,
        verify_lines,
    )

    out = Path(outdir)
    if not out.is_dir():
        raise AuditExportError(f"{out} is not an export directory", hint="pass the directory 'securetrain audit export' wrote")
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise AuditExportError(f"the export {out} is incomplete: no {', '.join(missing)}",
                               hint="copy the whole directory written by 'securetrain audit export'")
    manifest_text = _read_text(out / "manifest.json")
    notes_text = _read_text(out / "checkpoints.note")
    latest_text = _read_text(out / "checkpoint.note")
    # Exports made before key rotation existed have no handovers.notes (if the manifest names it,
    # the digest check below requires it).
    handovers = split_notes(_read_text(out / "handovers.notes")) if (out / "handovers.notes").is_file() else []
    key_source = "pinned"
    if public_key is None:
        key_source = "embedded"
        try:
            embedded = load_public_key_pem((out / "public_key.pem").read_bytes())
        except OSError:
            raise AuditExportError("the export has no readable public_key.pem and no --public-key was given") from None
        public_key = root_key(embedded, handovers)  # the embedded key is the newest; start where it began

    def failed(problem: str, message: str) -> VerifyReport:
        return VerifyReport(False, 0, "", error=AuditIntegrityError(message, problem=problem), key_source=key_source)

    try:
        manifest = json.loads(manifest_text)
    except json.JSONDecodeError:
        return failed("manifest", "manifest.json is not JSON")
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT or manifest.get("version") != EXPORT_VERSION:
        return failed("manifest", "manifest.json: unknown export format")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return failed("manifest", "manifest.json has no file digests")
    for name in ("checkpoints.note", "checkpoint.note", "public_key.pem", "verifier_key.txt", "entries.jsonl"):
        if name not in files:
            return failed("manifest", f"manifest.json lists no digest for {name}")
    for name, want in sorted(files.items()):
        if name == "entries.jsonl":
            continue  # hashed while it is streamed below
        if "/" in name or name.startswith(".") or not (out / name).is_file():
            return failed("manifest", f"manifest.json names {name!r}, which is not a file of the export")
        if hashlib.sha256((out / name).read_bytes()).hexdigest() != want:
            return failed("manifest", f"{name}: SHA-256 does not match manifest.json (damaged or altered)")

    try:
        chain = key_chain(public_key, handovers)
    except AuditIntegrityError as exc:
        return failed(exc.problem, f"handovers.notes: {exc}")
    digest = hashlib.sha256()
    with open(out / "entries.jsonl", "rb") as handle:
        start = None
        if since_checkpoint is not None:
            try:
                start = _resume_point(out, since_checkpoint, chain, handle)
            except AuditIntegrityError as exc:
                report = VerifyReport(False, 0, "", error=exc.with_traceback(None), key_source=key_source)
                return report
        entries = out / "entries.jsonl"
        if workers is None:
            workers = default_workers(entries.stat().st_size)
        if start is None and workers > 1:
            report = verify_file_parallel(entries, workers=workers, public_key=chain,
                                          checkpoint_notes=split_notes(notes_text), trusted_notes=trusted_notes,
                                          on_entry=on_entry, chunk_bytes=chunk_bytes or PARALLEL_CHUNK_BYTES,
                                          digest=digest)
        else:
            report = verify_lines(iter_line_batches(handle, digest=None if start else digest), public_key=chain,
                                  checkpoint_notes=split_notes(notes_text), trusted_notes=trusted_notes,
                                  on_entry=on_entry, require_signed=True, start=start)
    report.key_source = key_source
    if not report.ok:
        return report

    def fail(problem: str, message: str) -> VerifyReport:
        report.ok, report.error = False, AuditIntegrityError(message, problem=problem)
        return report

    if start is not None:
        report.warnings.append(f"incremental: entries 0..{start[0].size - 1} were authenticated by the held checkpoint "
                               "(not re-parsed); the manifest digest of entries.jsonl was not recomputed")
    elif digest.hexdigest() != files["entries.jsonl"]:
        return fail("manifest", "entries.jsonl: SHA-256 does not match manifest.json (damaged or altered)")
    size, root = report.entries, report.root_hash
    latest_notes = split_notes(latest_text)
    if size == 0 and not latest_notes:
        want_root = None
    elif len(latest_notes) != 1:
        return fail("checkpoint-note", "checkpoint.note must hold exactly the newest checkpoint")
    else:
        try:
            latest, _ = open_checkpoint_note(latest_notes[0], chain, trusted=False)
        except AuditIntegrityError as exc:
            return fail(exc.problem, f"checkpoint.note: {exc}")
        if latest.tree_size != size or latest.root_hash.hex() != root:
            return fail("checkpoint-note", f"checkpoint.note signs a tree of {latest.tree_size} entries that is not the "
                                           f"exported one ({size} entries, root {root})")
        want_root = root
    if manifest.get("entries") != size or manifest.get("tree_size") != size or manifest.get("root_hash") != want_root:
        return fail("manifest", f"manifest.json says entries={manifest.get('entries')!r}, tree_size="
                                f"{manifest.get('tree_size')!r}, root_hash={manifest.get('root_hash')!r}; the export "
                                f"holds {size} entries with root {root}")
    if key_source == "embedded":
        report.warnings.append("UNTRUSTED: checked against the export's own public_key.pem, which proves only that "
                               "the export is self-consistent; pass the log's public key you obtained independently")
    return report


def _resume_point(out: Path, held_text: str, public_key: Any, handle: Any) -> tuple[CompactRange, str] | None:
    """Authenticated (compact range, chain head) at the held checkpoint; ``handle`` is left after it."""
    from securetrain.audit.errors import AuditExportError, AuditIntegrityError
    from securetrain.audit.note import split_notes
    from securetrain.audit.verify import MAX_LINE_BYTES, open_checkpoint_note

    def fail(message: str) -> AuditIntegrityError:
        return AuditIntegrityError(message, problem="incremental")

    notes = split_notes(held_text) or [held_text]
    held = max((open_checkpoint_note(n, public_key, trusted=True)[0] for n in notes), key=lambda c: c.tree_size)
    size = held.tree_size
    if size == 0:
        return None  # nothing held: a full verification
    path = out / "ranges.jsonl"
    if not path.is_file():
        raise AuditExportError("the export has no ranges.jsonl (it predates incremental verification)",
                               hint="verify it fully (without --since-checkpoint)")
    record = None
    with open(path, "rb") as ranges:
        for line in ranges:
            try:
                item = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise fail("ranges.jsonl holds a line that is not JSON") from None
            if isinstance(item, dict) and item.get("tree_size") == size:
                record = item
                break
    if record is None:
        raise fail(f"the export has no compact range at the held checkpoint's size {size} "
                   "(not a checkpoint of this log, or ranges.jsonl was cut)")
    try:
        tree = CompactRange.from_peaks(size, [bytes.fromhex(p) for p in record["peaks"]])
        offset = int(record["lowest_offset"])
    except (KeyError, TypeError, ValueError):
        raise fail(f"ranges.jsonl: malformed compact range for size {size}") from None
    if tree.root() != held.root_hash:
        raise fail(f"the export's compact range at size {size} does not match the held checkpoint "
                   "(history before it was rewritten)")
    # Re-hash the leaves of the smallest peak: authenticates entry size-1, whose hash the next entry chains to.
    handle.seek(max(offset, 0))
    sub, last = CompactRange(), b""
    for _ in range(size & -size):
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line.endswith(b"\n"):
            raise fail(f"entries.jsonl ends or breaks before the held checkpoint's size {size}")
        last = line[:-1]
        sub.append(leaf_hash(last))
    if sub.root() != tree.peaks()[-1]:
        raise fail(f"entries before {size} do not match the held checkpoint (history before it was rewritten)")
    return tree, hashlib.sha256(last).hexdigest()

"""Full verification of an audit log (from the database or an export).

Checks, in order, for every entry: dense ``seq`` from 0, known format version and field types,
canonical encoding, ``prev_hash`` linking to the previous entry's hash, the stored ``entry_hash``
(when there is one). Then every checkpoint — the log's own and the ones the auditor trusts — must
carry a valid Ed25519 signature by the trusted key, and its root must equal the Merkle root of the
first ``tree_size`` entries. A checkpoint larger than the log means the tail was removed. After a
key rotation, later keys are accepted only through signed hand-overs (:mod:`securetrain.audit.handover`),
each within the tree sizes it may sign, and each hand-over's root is met like a checkpoint's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import json.encoder
import json.scanner
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from securetrain.audit.canonical import entry_bytes as _entry_bytes
from securetrain.audit.canonical import (
    GENESIS_HASH,
    sha256_hex,
)
from securetrain.audit.entrycheck import ASTRAL as _ASTRAL
from securetrain.audit.entrycheck import ENTRY_HEAD as _ENTRY_HEAD
from securetrain.audit.entrycheck import ENTRY_TAIL as _ENTRY_TAIL
from securetrain.audit.entrycheck import SERVER_VIEW_TEXT as _SERVER_VIEW_TEXT
from securetrain.audit.entrycheck import check_entry as check_entry  # re-exported: part of this module's API
from securetrain.audit.entrycheck import check_object as check_object
from securetrain.audit.entrycheck import fast_accept as fast_accept
from securetrain.audit.entrycheck import read_chunk_lines as read_chunk_lines
from securetrain.audit.entrycheck import verify_chunk as verify_chunk
from securetrain.audit.entrycheck import details_canonical as _details_canonical
from securetrain.audit.entrycheck import fail as _fail
from securetrain.audit.entrycheck import parse_line as _parse_line
from securetrain.audit.errors import AuditEventError, AuditIntegrityError
from securetrain.audit.handover import HandoverPoint, KeyChain, build_chain, open_with_chain, parse_handover
from securetrain.audit.merkle import CompactRange, leaf_hash
from securetrain.audit.note import Checkpoint, find_signer, parse_checkpoint_text, split_notes, verify_note

@dataclass
class VerifyReport:
    ok: bool
    entries: int
    root_hash: str
    checkpoints_verified: int = 0
    trusted_verified: int = 0
    #: key hand-overs followed (their tree size and root matched the log)
    handovers_verified: int = 0
    latest_checkpoint_size: int | None = None
    error: AuditIntegrityError | None = None
    warnings: list[str] = field(default_factory=list)
    #: "pinned" (a key the auditor supplied), "log" (the database's own key) or "embedded" (the
    #: export's own public_key.pem: proves self-consistency only, anyone can re-sign with a new key).
    key_source: str = "pinned"

    @property
    def trusted(self) -> bool:
        """Verified against a key that did not come with the data being verified."""
        return self.key_source != "embedded"

    def raise_for_failure(self) -> None:
        if self.error is not None:
            raise self.error

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "entries": self.entries, "root_hash": self.root_hash,
            "checkpoints_verified": self.checkpoints_verified, "trusted_verified": self.trusted_verified,
            "handovers_verified": self.handovers_verified,
            "latest_checkpoint_size": self.latest_checkpoint_size,
            "error": None if self.error is None else {"seq": self.error.seq, "problem": self.error.problem, "message": str(self.error)},
            "warnings": self.warnings, "key_source": self.key_source, "trusted": self.trusted,
        }


@dataclass
class Record:
    """One entry as the verifier sees it: the hashed bytes, parsed, and the stored hash if any."""

    raw: bytes
    obj: Any
    stored_hash: str | None = None
    stored_seq: int | None = None
    #: ``raw`` was produced from ``obj`` by a canonical encoder (so re-encoding to compare is skipped).
    canonical: bool = False


class _Walk:
    """The state of one verification pass: chain head, Merkle tree, checkpoints still to meet."""

    def __init__(self, pending: list[tuple[Checkpoint, bool]], report: VerifyReport, *,
                 tree: CompactRange | None = None, prev: str = GENESIS_HASH,
                 on_entry: Callable[[int], None] | None = None) -> None:
        self.tree = tree or CompactRange()
        self.prev = prev
        self.pending = pending
        self.report = report
        self.on_entry = on_entry

    def settle(self) -> None:
        tree, pending = self.tree, self.pending
        while pending and pending[0][0].tree_size == tree.size:
            cp, is_trusted = pending.pop(0)
            if cp.root_hash != tree.root():
                kind = _kind(cp, is_trusted)
                raise _fail(tree.size - 1 if tree.size else None, "checkpoint-root",
                            f"Merkle root of the first {cp.tree_size} entries does not match the {kind} checkpoint "
                            "(history before it was rewritten)")
            if isinstance(cp, HandoverPoint):
                self.report.handovers_verified += 1
            elif is_trusted:
                self.report.trusted_verified += 1
            else:
                self.report.checkpoints_verified += 1

    def _add_leaves(self, leaves: list[bytes]) -> None:
        """Append leaves, stopping at every checkpoint size to compare roots."""
        i = 0
        while i < len(leaves):
            stop = len(leaves)
            if self.pending:
                stop = min(stop, i + self.pending[0][0].tree_size - self.tree.size)
            self.tree.extend_batch(leaves[i:stop] if i or stop != len(leaves) else leaves)
            i = stop
            self.report.entries = self.tree.size
            self.settle()
        if self.on_entry is not None:
            self.on_entry(self.tree.size)

    def lines(self, batch: list[bytes]) -> None:
        """Verify a batch of export lines (each exactly the hashed bytes, newline stripped)."""
        sha256 = hashlib.sha256
        head_match, tail_match, details_ok, astral = _ENTRY_HEAD, _ENTRY_TAIL, _details_canonical, _ASTRAL
        seq, prev = self.tree.size, self.prev
        leaves: list[bytes] = []
        append = leaves.append
        for raw in batch:
            # fast_accept(), inlined: this loop runs once per entry.
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                text = ""
            head = head_match(text)
            end = text.rfind('},"hostname":"')
            tail = tail_match(text, end + 1) if head is not None and end >= head.end() - 1 else None
            if not (head is not None and tail is not None and tail[1] == prev and tail[2] == str(seq)
                    and (text.isascii() or astral(text) is None) and details_ok(text[head.end() - 1 : end + 1])):
                try:
                    check_entry(raw, _parse_line(raw, seq), seq, prev)
                except AuditIntegrityError:
                    self._add_leaves(leaves)  # checkpoints met before the bad entry are still reported
                    raise
            prev = sha256(raw).hexdigest()
            append(sha256(b"\x00" + raw).digest())
            seq += 1
        self.prev = prev
        self._add_leaves(leaves)

    def rows(self, batch: list[tuple], exact: Callable[[Any], Record]) -> None:
        """Verify a batch of database rows: ``(seq, ts, actor, hostname, mac, action, resource,
        outcome, details, prev_hash, entry_hash, server_view, handle)``, the text columns as stored.

        The entry's bytes are the writer's template filled with the row (``canonical.entry_bytes``),
        which fixes the structure and escapes every field canonically. What the template cannot
        vouch for is checked here: the next ``seq``, ``prev_hash`` linking to the previous entry,
        ``details`` (and ``server_view``) canonical, and the stored ``entry_hash``. A row that does
        not pass is checked by :meth:`record` on ``exact(handle)`` (parsed and re-encoded), which
        names the problem or, for an unusual but sound entry (say, a character beyond U+FFFF in its
        details), accepts it.
        """
        sha256, template = hashlib.sha256, _entry_bytes
        details_ok, view_ok, astral = _details_canonical, _SERVER_VIEW_TEXT, _ASTRAL
        seq, prev = self.tree.size, self.prev
        leaves: list[bytes] = []
        append = leaves.append
        for (row_seq, ts, actor, hostname, mac, action, resource, outcome, details, prev_hash, stored, view,
             handle) in batch:
            raw: bytes | None = None
            if (row_seq == seq and type(row_seq) is int and prev_hash == prev and type(details) is str
                    and (details.isascii() or astral(details) is None) and details_ok(details)
                    and (view is None or (type(view) is str and view_ok(view) is not None))):
                try:
                    raw = template(seq=seq, ts=ts, actor=actor, hostname=hostname, mac=mac, action=action,
                                   resource=resource, outcome=outcome, details_json=details, prev_hash=prev_hash,
                                   server_view_json=view)
                except (AuditEventError, TypeError):  # a lone surrogate, a NULL: the exact check names it
                    raw = None
            digest = "" if raw is None else sha256(raw).hexdigest()
            if raw is None or digest != stored:
                self.prev = prev
                self._add_leaves(leaves)
                leaves = []
                append = leaves.append
                self.record(exact(handle))
                seq, prev = self.tree.size, self.prev
                continue
            append(sha256(b"\x00" + raw).digest())
            prev = digest
            seq += 1
        self.prev = prev
        self._add_leaves(leaves)

    def chunk(self, result: tuple, reread: Callable[[], list[bytes]]) -> None:
        """Take a chunk verified by :func:`verify_chunk` in another process.

        Its claims (first ``seq`` and ``prev_hash``) must continue this walk exactly; otherwise, or
        when the worker found a problem, the chunk is re-checked here, sequentially, which raises
        at the first bad entry with the same message as a sequential run.
        """
        count, first_seq, first_prev, last_hash, leaves, ok = result
        if count == 0:
            return
        if not ok or first_seq != self.tree.size or first_prev != self.prev:
            self.lines(reread())
            return
        self._add_leaves(leaves)
        self.prev = last_hash

    def record(self, rec: Record) -> None:
        """Verify one entry read from a database (with its stored seq and entry_hash)."""
        expected = self.tree.size
        if rec.stored_seq is not None and rec.stored_seq != expected:
            raise _fail(expected, "seq-gap", f"expected seq {expected}, found row with seq {rec.stored_seq} "
                                             "(an entry was deleted, inserted or reordered)")
        check_entry(rec.raw, rec.obj, expected, self.prev, raw_is_canonical=rec.canonical)
        digest = sha256_hex(rec.raw)
        if rec.stored_hash is not None and rec.stored_hash != digest:
            raise _fail(expected, "entry_hash", "stored entry_hash does not match the entry's content")
        self.prev = digest
        self.tree.append(leaf_hash(rec.raw))
        self.report.entries = self.tree.size
        self.settle()
        if self.on_entry is not None:
            self.on_entry(self.tree.size)


#: The auditor's trusted key(s), or a key chain already built from them and the hand-overs.
TrustedKeys = Ed25519PublicKey | Sequence[Ed25519PublicKey] | KeyChain | None


def _kind(cp: Checkpoint, is_trusted: bool) -> str:
    return "hand-over" if isinstance(cp, HandoverPoint) else "trusted" if is_trusted else "stored"


def key_chain(public_key: TrustedKeys, handover_notes: Sequence[str] = ()) -> KeyChain | None:
    """The chain verifiers follow: trusted keys, extended by valid hand-overs (raises if one does not link)."""
    if public_key is None or isinstance(public_key, KeyChain):
        return public_key
    keys = [public_key] if isinstance(public_key, Ed25519PublicKey) else list(public_key)
    return build_chain(keys, handover_notes)


def _open_notes(public_key: TrustedKeys, checkpoint_notes: Iterable[str],
                trusted_notes: Iterable[str]) -> tuple[list[tuple[Checkpoint, bool]], list[tuple[Checkpoint, bool]]]:
    own = [open_checkpoint_note(n, public_key, trusted=False) for n in checkpoint_notes]
    trusted = [open_checkpoint_note(n, public_key, trusted=True) for blob in trusted_notes for n in (split_notes(blob) or [blob])]
    return own, trusted


def _finish(walk: _Walk, own: list, trusted: list, *, require_signed: bool) -> None:
    cr = walk.tree
    covered = max([c.tree_size for c, _ in own + trusted], default=0)
    if require_signed and not walk.pending and covered < cr.size:
        raise _fail(covered, "unsigned", f"entries {covered}..{cr.size - 1} are not covered by a signed "
                                         "checkpoint (appended after the export, or its checkpoints were removed)")
    if walk.pending:
        cp, is_trusted = walk.pending[0]
        raise _fail(cr.size, "truncated", f"the log has {cr.size} entries but a {_kind(cp, is_trusted)} "
                                          f"checkpoint covers {cp.tree_size}: the tail was removed")


def verify_records(
    records: Iterable[Record],
    *,
    public_key: TrustedKeys,
    checkpoint_notes: Iterable[str] = (),
    trusted_notes: Iterable[str] = (),
    handover_notes: Sequence[str] = (),
    on_entry: Callable[[int], None] | None = None,
    require_signed: bool = False,
) -> VerifyReport:
    """Verify a stream of entries against checkpoints. Never raises for integrity problems.

    ``require_signed=True`` (exports: they always end at a checkpoint) fails when entries follow the
    newest checkpoint; otherwise (a live database) they are reported as a warning. Each of
    ``trusted_notes`` may hold several concatenated notes (an anchor file).
    """
    def walk_all(walk: _Walk) -> None:
        for rec in records:
            walk.record(rec)

    return _run(public_key, checkpoint_notes, trusted_notes, on_entry, require_signed, walk_all, records,
                handover_notes=handover_notes)


def verify_rows(
    batches: Iterable[list[tuple]],
    exact: Callable[[Any], Record],
    *,
    public_key: TrustedKeys,
    checkpoint_notes: Iterable[str] = (),
    trusted_notes: Iterable[str] = (),
    handover_notes: Sequence[str] = (),
    on_entry: Callable[[int], None] | None = None,
) -> VerifyReport:
    """:func:`verify_records` for a database read in batches of rows (see :meth:`_Walk.rows`);
    ``exact(handle)`` builds the :class:`Record` of a row the fast check does not accept."""
    def walk_all(walk: _Walk) -> None:
        for batch in batches:
            walk.rows(batch, exact)

    return _run(public_key, checkpoint_notes, trusted_notes, on_entry, False, walk_all, batches,
                handover_notes=handover_notes)


def verify_lines(
    batches: Iterable[list[bytes]],
    *,
    public_key: TrustedKeys,
    checkpoint_notes: Iterable[str] = (),
    trusted_notes: Iterable[str] = (),
    handover_notes: Sequence[str] = (),
    on_entry: Callable[[int], None] | None = None,
    require_signed: bool = True,
    start: tuple[CompactRange, str] | None = None,
) -> VerifyReport:
    """Verify an export's entry lines, given in batches (see :func:`iter_line_batches`).

    ``start = (tree, prev_hash)`` continues a verification from an authenticated compact range
    (incremental verification): the batches then begin with line ``tree.size``, and checkpoints
    at or below that size are not re-checked (a warning says how many).
    """

    def run(walk: _Walk) -> None:
        for batch in batches:
            walk.lines(batch)

    return _run(public_key, checkpoint_notes, trusted_notes, on_entry, require_signed, run, batches, start=start,
                handover_notes=handover_notes)


#: Byte range one worker checks at a time (small ranges balance the workers; ~2,400 entries each).
PARALLEL_CHUNK_BYTES = 1 << 20


def verify_file_parallel(
    path: str | Any,
    *,
    workers: int,
    public_key: TrustedKeys,
    checkpoint_notes: Iterable[str] = (),
    trusted_notes: Iterable[str] = (),
    handover_notes: Sequence[str] = (),
    on_entry: Callable[[int], None] | None = None,
    chunk_bytes: int = PARALLEL_CHUNK_BYTES,
    digest: Any = None,
) -> VerifyReport:
    """:func:`verify_lines` over a whole ``entries.jsonl``, the per-entry checks spread over processes.

    The file is cut into byte ranges (each line belongs to the range its first byte falls in);
    worker ``k`` of ``W`` checks ranges ``k, k+W, k+2W, ...``, every entry relative to its range's
    first entry, and streams back the range's leaf hashes (32 bytes each, no pickling); this process
    chains the ranges (first ``seq``/``prev_hash`` against the previous range), builds the Merkle
    tree and meets the checkpoints, and feeds ``digest`` (a hashlib object) the file's bytes range
    by range while the workers run. A range with any problem (or whose worker died) is re-checked
    here sequentially, so the reported failure is the same as a sequential run's. Memory stays
    bounded: each worker is at most one range ahead of this process (pipe back-pressure).

    Workers are plain ``python -c`` processes that import only :mod:`securetrain.audit.entrycheck`: a multiprocessing
    ``spawn`` pool would re-import the parent's ``__main__`` (the whole CLI for the ``securetrain``
    console script) in every worker, and pickle every leaf hash as a separate object.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    size = os.path.getsize(path)
    step = max(int(chunk_bytes), 1)
    ranges = [(str(path), lo, min(lo + step, size)) for lo in range(0, size, step)]
    workers = max(1, min(workers, len(ranges)))
    root = str(Path(__file__).resolve().parents[2])
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
            "from securetrain.audit.entrycheck import chunk_worker_main; chunk_worker_main(sys.argv[1:])")

    def run(walk: _Walk) -> None:
        procs = [subprocess.Popen([sys.executable, "-c", code, root, str(path), str(size), str(step), str(k), str(workers)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                 for k in range(workers)]
        alive = [True] * workers
        try:
            with open(path, "rb") as handle:
                for i, rng in enumerate(ranges):
                    k = i % workers
                    result = _read_chunk_result(procs[k].stdout) if alive[k] else None
                    if result is None:
                        if all(alive):
                            walk.report.warnings.append("a verification worker process failed; its byte ranges "
                                                        "were checked sequentially")
                        alive[k] = False
                        result = (1, None, None, None, [], False)  # re-check this range here
                    walk.chunk(result, functools.partial(read_chunk_lines, *rng))
                    if digest is not None:
                        digest.update(handle.read(rng[2] - rng[1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()

    return _run(public_key, checkpoint_notes, trusted_notes, on_entry, True, run, None,
                handover_notes=handover_notes)


def _read_chunk_result(stream: Any) -> tuple | None:
    """One range's result from a worker: its JSON header line, then ``count`` 32-byte leaf hashes."""
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


def _run(public_key: TrustedKeys, checkpoint_notes: Iterable[str], trusted_notes: Iterable[str],
         on_entry: Callable[[int], None] | None, require_signed: bool, body: Callable[[_Walk], Any],
         source: Any, *, start: tuple[CompactRange, str] | None = None,
         handover_notes: Sequence[str] = ()) -> VerifyReport:
    report = VerifyReport(True, 0, CompactRange().root().hex())
    try:
        chain = key_chain(public_key, handover_notes)
        if chain is None:  # no key: hand-overs are checked for form only, like the checkpoints
            points = [HandoverPoint(h.origin, h.tree_size, h.root_hash, h.note)
                      for h in (parse_handover(n)[1] for n in handover_notes)]
        else:
            points = chain.points()
        own, trusted = _open_notes(chain, checkpoint_notes, trusted_notes)
        trusted += [(p, False) for p in points]
        origins = sorted({c.origin for c, _ in own + trusted})
        if len(origins) > 1:  # one log, one origin (as audit/verify_audit.py checks)
            raise AuditIntegrityError(f"checkpoints come from different logs: {origins}", problem="checkpoint-origin")
    except AuditIntegrityError as exc:
        _close(source)
        return VerifyReport(False, 0, report.root_hash, error=exc.with_traceback(None))
    if own:
        report.latest_checkpoint_size = max(c.tree_size for c, _ in own)
    if chain is None and (own or trusted):
        report.warnings.append("no trusted public key given: checkpoint signatures were checked only for form")
    pending = sorted(own + trusted, key=lambda item: item[0].tree_size)
    if start is None:
        walk = _Walk(pending, report, on_entry=on_entry)
    else:
        tree, prev = start
        skipped = sum(1 for c, _ in pending if c.tree_size < tree.size)
        if skipped:
            report.warnings.append(f"{skipped} checkpoints older than the held one (size {tree.size}) were not "
                                   "re-checked: incremental verification relies on the earlier full one")
        walk = _Walk([p for p in pending if p[0].tree_size >= tree.size], report, tree=tree, prev=prev,
                     on_entry=on_entry)
        report.entries = tree.size
    try:
        walk.settle()
        body(walk)
        _finish(walk, own, trusted, require_signed=require_signed)
    except AuditIntegrityError as exc:
        # Drop the traceback: it would keep the records generator (and its DB transaction) alive.
        report.ok, report.error = False, exc.with_traceback(None)
    finally:
        _close(source)
    report.root_hash = walk.tree.root().hex()
    latest = report.latest_checkpoint_size
    if report.ok and (latest is None or latest < walk.tree.size):
        uncovered = walk.tree.size - (latest or 0)
        report.warnings.append(f"{uncovered} newest entries are not yet covered by a signed checkpoint")
    return report


def _close(source: Any) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()  # release the reader's connection/transaction now, not at garbage collection


def open_checkpoint_note(note: str, public_key: TrustedKeys, *, trusted: bool) -> tuple[Checkpoint, bool]:
    """Parse a signed checkpoint note, verified against ``public_key`` (a key, keys or key chain) when given."""
    if public_key is not None and not isinstance(public_key, Ed25519PublicKey):
        origin, size, root = open_with_chain(note, key_chain(public_key) or KeyChain())
        return Checkpoint(origin, size, root, note), trusted
    if public_key is not None:
        name = find_signer(note, public_key)
        text = verify_note(note, name, public_key)
    else:
        from securetrain.audit.note import parse_note

        text, _ = parse_note(note)
    origin, size, root = parse_checkpoint_text(text)
    return Checkpoint(origin, size, root, note), trusted


#: Longest entry line accepted (details are capped at 16 KiB, text fields at 1024 characters).
MAX_LINE_BYTES = 1 << 20


def iter_line_batches(handle: Any, *, digest: Any = None, chunk: int = 1 << 20) -> Iterator[list[bytes]]:
    """Lines of a binary file, newline stripped, in batches; memory bounded by ``chunk`` + one line.

    ``digest`` (a hashlib object) is fed every byte read, so the file's SHA-256 costs no second pass.
    A line longer than :data:`MAX_LINE_BYTES` fails (:class:`AuditIntegrityError`) instead of
    being buffered.
    """
    carry = b""
    number = 0
    while True:
        buf = handle.read(chunk)
        if not buf:
            break
        if digest is not None:
            digest.update(buf)
        parts = (carry + buf).split(b"\n") if carry else buf.split(b"\n")
        carry = parts.pop()
        if len(carry) > MAX_LINE_BYTES:
            raise _fail(number + len(parts), "line-length", f"entry line longer than {MAX_LINE_BYTES} bytes")
        if parts:
            number += len(parts)
            yield parts
    if carry:
        yield [carry]  # a last line without its newline


def records_from_jsonl(lines: Iterable[bytes]) -> Iterable[Record]:
    """Records from an export's ``entries.jsonl`` (each line: the exact hashed bytes)."""
    for number, line in enumerate(lines):
        raw = line[:-1] if line.endswith(b"\n") else line
        yield Record(raw, _parse_line(raw, number))

"""De-identify a folder tree into another folder: the library behind ``securetrain deid``.

``deidentify_tree(src, dst, policy, key, workers=..., audit=..., dry_run=...)`` walks ``src``
recursively (sorted) and returns a :class:`TreeReport` with one :class:`FileResult` per input and
a :class:`FileOutcome` each:

* ``written`` / ``would_write`` (dry run) -- de-identified;
* ``rejected`` -- the policy refuses it on purpose (``burned_in: reject``: possible burned-in
  text; ``missing_patient_identity: reject``: no patient identity; ``encapsulated_documents:
  reject``: a PDF/CDA/model document; a DICOMDIR), with the reason;
* ``quarantined`` -- it could not be processed (not DICOM, truncated, a corrupt element, pixels
  that cannot be decoded or an object that cannot be encoded), with the reason.

Rejections are the policy working; quarantined files are a data problem. ``securetrain deid``
and the pipeline fail (exit 65, :func:`refusal_fails`) only for quarantined files, unless they
are accepted; rejected and quarantined files alike are listed in the refusal report
(:func:`refusal_report`).

Output names (``naming="uid"``, the default): ``<dst>/<new SOP Instance UID>.dcm``, the keyed
UID the de-identified object carries (as dicognito does), so no input file or folder name --
which may carry PHI, e.g. ``SMITH^JOHN_MRN123/`` -- reaches the output. ``naming="path"`` keeps
the relative input paths. The input -> output mapping exists only in the report (memory) and,
with ``securetrain deid --mapping-out``, encrypted. Reasons name an input by its index in the
sorted listing (``input #7``), never by its name; the audit log gets indexes and SHA-256 digests.

Work goes to ``workers`` processes in chunks; each chunk's files are written with a
:class:`~securetrain.masking.dicom.output.BatchWriter` (one fsync per file plus one per directory
per chunk) and count as written only after the chunk's flush. Audit events are recorded as each
chunk completes (not at the end), so an interrupted run leaves entries for every chunk it wrote:
one ``dicom.read`` per input read (with its sha256), one ``deid.write`` per output (its name and
the input's sha256), one ``deid.reject``/``deid.quarantine`` per refusal. Reasons and reports never
carry attribute values.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from securetrain.errors import ConfigError
from securetrain.masking.dicom.folders import candidate_files
from securetrain.masking.dicom.policy import DicomPolicy

#: ``format`` of a refusal report (``securetrain deid``'s ``OUT.quarantine.json``).
REFUSAL_REPORT_FORMAT = "securetrain.deid.refusals/1"


class FileOutcome(str, Enum):
    WRITTEN = "written"
    WOULD_WRITE = "would_write"
    REJECTED = "rejected"
    QUARANTINED = "quarantined"


@dataclass
class FileResult:
    source: str  # path relative to the input root (in memory only: never logged or audited)
    outcome: FileOutcome
    reason: str | None = None
    tags_changed: int = 0
    # dry runs: (tag, keyword, action, nested) per change; never values
    changes: list[tuple[int, str, str, bool]] = field(default_factory=list)
    index: int = 0  # 1-based position in the sorted input listing
    sha256: str | None = None  # of the input file
    output: str | None = None  # path relative to the output root


@dataclass
class TreeReport:
    results: list[FileResult] = field(default_factory=list)
    pseudonyms: dict[str, str] = field(default_factory=dict)  # original id -> pseudonym (export encrypted!)
    events: list[dict[str, Any]] = field(default_factory=list)  # audit events, already recorded if audit given

    def count(self, outcome: FileOutcome) -> int:
        return sum(r.outcome == outcome for r in self.results)

    @property
    def written(self) -> int:
        return self.count(FileOutcome.WRITTEN) + self.count(FileOutcome.WOULD_WRITE)

    @property
    def rejected(self) -> int:
        return self.count(FileOutcome.REJECTED)

    @property
    def quarantined(self) -> int:
        return self.count(FileOutcome.QUARANTINED)

    @property
    def tags_changed(self) -> int:
        return sum(r.tags_changed for r in self.results)


# ----------------------------------------------------------------------------- worker side
_WORKER: Any = None


class _SigintDeferral:
    """Holds Ctrl-C from a chunk's flush until its audit events are recorded (in-process runs), so
    an interrupted run never leaves outputs of a finished chunk without their entries."""

    def __init__(self) -> None:
        self.active = False
        self.pending = False
        self.old: Any = None

    def start(self) -> None:
        import multiprocessing
        import signal
        import threading

        if self.active or threading.current_thread() is not threading.main_thread() \
                or multiprocessing.parent_process() is not None:
            return
        self.old = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._hold)
        self.active = True

    def _hold(self, signum: int, frame: Any) -> None:
        self.pending = True

    def stop(self) -> None:
        import signal

        if not self.active:
            return
        signal.signal(signal.SIGINT, self.old)
        self.active = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


_DEFER = _SigintDeferral()


def _init_worker(policy: DicomPolicy, key: bytes, record_changes: bool) -> None:
    global _WORKER
    from securetrain.audit.recorder import MemoryAuditRecorder
    from securetrain.masking.dicom.engine import Deidentifier

    # Workers cannot share the parent's database handle: events go back with the results.
    _WORKER = Deidentifier(policy, key, MemoryAuditRecorder(), record_changes=record_changes)


def _output_name(report: Any) -> str:
    uid = report.sop_instance_uid
    if not uid:  # no instance UID at all: a keyed name from the content digest
        uid = _WORKER.mapper.uid(f"sha256:{report.input_sha256}")
    return f"{uid}.dcm"


def _sha256_of(path: str) -> str | None:
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None


def _process_chunk(job: tuple[list[tuple[int, str, str]], str | None, str]) -> tuple[list[dict[str, Any]], dict[str, str], list]:
    """(results, new pseudonyms, read events) for one chunk of (index, source, relative name).

    ``target``: the output folder (or, for ``naming="file"``, the output file); ``None`` on dry runs."""
    from securetrain.masking.dicom.errors import (
        BurnedInAnnotationError,
        DeidError,
        DicomDirectoryError,
        EncapsulatedDocumentError,
        MissingPatientIdentityError,
    )
    from securetrain.masking.dicom.output import BatchWriter

    chunk, target, naming = job
    before = dict(_WORKER.pseudonyms)
    results: list[dict[str, Any]] = []
    writer = BatchWriter(max_pending=len(chunk) + 1)
    try:
        for index, src, rel in chunk:
            base = {"index": index, "source": rel}
            dst: Any
            if target is None:
                dst = None
            elif naming == "file":
                dst = target
            elif naming == "path":
                dst = os.path.join(target, rel)
            else:
                dst = lambda report, _t=target: os.path.join(_t, _output_name(report))  # noqa: E731
            writer.last_sha256 = None
            try:
                report = _WORKER.deidentify_file(src, dst, dry_run=target is None, writer=writer, label=f"input #{index}")
            except (BurnedInAnnotationError, MissingPatientIdentityError, DicomDirectoryError,
                    EncapsulatedDocumentError) as exc:  # refused on purpose
                results.append({**base, "outcome": "rejected", "reason": str(exc), "sha256": _sha256_of(src)})
                continue
            except DeidError as exc:  # UnreadableDicomError, or an object that cannot be processed
                results.append({**base, "outcome": "quarantined", "reason": str(exc), "sha256": _sha256_of(src)})
                continue
            changes = [(c.tag, c.keyword, c.action, "." in c.path) for c in report.changes] if target is None else []
            output = os.path.relpath(report.output, target) if report.output and naming != "file" else (
                os.path.basename(report.output) if report.output else None)
            results.append({**base, "outcome": "would_write" if target is None else "written",
                            "tags_changed": report.tags_changed, "changes": changes,
                            "sha256": report.input_sha256, "output": output, "output_sha256": writer.last_sha256})
        _DEFER.start()  # in-process: Ctrl-C waits until this chunk is recorded
        writer.flush()  # only now are the chunk's files "written"
    except BaseException:
        writer.abort()
        _DEFER.stop()
        raise
    events = [e for e in _WORKER.audit.events if e["action"] == "dicom.read"]
    _WORKER.audit.events.clear()
    new = {k: v for k, v in _WORKER.pseudonyms.items() if k not in before}
    return results, new, events


# ----------------------------------------------------------------------------- caller side
NAMINGS = ("uid", "path")


def plan_tree(src: Path, dst: Path, *, dry_run: bool) -> list[tuple[str, str, str | None]]:
    """(source, relative name, target or None) for every file below ``src`` (or ``src`` itself)."""
    if not src.exists():
        raise ConfigError(f"input {src} does not exist")
    if src.is_dir():
        if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
            raise ConfigError("OUT must not be IN or inside IN", hint="choose a separate output folder")
        files = candidate_files(src)
        if not files:
            raise ConfigError(f"input folder {src} contains no files (operating-system metadata such as .DS_Store "
                              "is skipped)", hint="check the path (IN is searched recursively)")
        return [(str(p), str(p.relative_to(src)), None if dry_run else str(dst / p.relative_to(src))) for p in files]
    return [(str(src), src.name, None if dry_run else str(dst))]


def _chunks(tasks: list, workers: int) -> Iterator[list]:
    size = max(1, min(64, len(tasks) // max(1, workers * 4) or 1))
    for i in range(0, len(tasks), size):
        yield tasks[i : i + size]


def _refusal_event(r: FileResult) -> dict[str, Any]:
    return {"action": "deid.reject" if r.outcome == FileOutcome.REJECTED else "deid.quarantine",
            "resource": f"input:#{r.index}", "outcome": "refused",
            "details": {"index": r.index, "sha256": r.sha256, "reason": (r.reason or "")[:200]}}


def _write_event(r: FileResult) -> dict[str, Any]:
    return {"action": "deid.write", "resource": f"file:{r.output}", "outcome": "success",
            "details": {"index": r.index, "input_sha256": r.sha256, "output": r.output}}


def deidentify_tree(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    policy: DicomPolicy,
    key: bytes,
    *,
    workers: int = 1,
    audit: Any = None,
    dry_run: bool = False,
    progress: Callable[[FileResult], None] | None = None,
    naming: str = "uid",
) -> TreeReport:
    """De-identify every file under ``src`` into ``dst``; see module doc.

    ``audit``: a recorder, or a zero-argument callable returning one -- called once the worker
    processes exist, so they never inherit its database handle. Events are recorded per chunk."""
    from securetrain.masking.dicom.keys import DeidKeys

    if naming not in NAMINGS:
        raise ConfigError(f"unknown output naming {naming!r}", hint=f"use one of {', '.join(NAMINGS)}")
    keys = DeidKeys.from_secret(key)  # validate before any work
    src_path, dst_path = Path(src), Path(dst)
    plan = plan_tree(src_path, dst_path, dry_run=dry_run)
    single = not src_path.is_dir()
    tasks = [(i, source, rel) for i, (source, rel, _) in enumerate(plan, start=1)]
    target = None if dry_run else str(dst_path)
    mode = "file" if single else naming
    report = TreeReport()
    claims = _OutputClaims(dst_path) if mode == "uid" and not dry_run else None
    jobs = [(chunk, target, mode) for chunk in _chunks(tasks, workers)]
    if workers <= 1 or len(jobs) <= 1:
        _init_worker(policy, key, dry_run)
        outputs: Iterator = map(_process_chunk, jobs)
        pool = None
    else:
        import securetrain.masking.dicom.engine  # noqa: F401  -- imported once here, inherited by forked workers

        pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(policy, key, dry_run))
        outputs = pool.map(_process_chunk, jobs)  # forks every worker now, before the audit log opens
    recorder = None
    try:
        if audit is not None:  # workers (if any) exist now: pool.map has submitted every chunk
            recorder = audit() if callable(audit) and not hasattr(audit, "record") else audit
            _record(recorder, [_policy_event(policy, keys.key_id, dry_run)])
        for results, pseudonyms, events in outputs:
            report.pseudonyms.update(pseudonyms)
            chunk_events = list(events)
            for r in results:
                item = FileResult(r["source"], FileOutcome(r["outcome"]), r.get("reason"), r.get("tags_changed", 0),
                                  [tuple(c) for c in r.get("changes", [])], r["index"], r.get("sha256"), r.get("output"))
                report.results.append(item)
                if item.outcome == FileOutcome.WRITTEN and claims is not None:
                    chunk_events += claims.settle(item, r.get("output_sha256"))
                if item.outcome == FileOutcome.WRITTEN:
                    chunk_events.append(_write_event(item))
                elif item.outcome in (FileOutcome.REJECTED, FileOutcome.QUARANTINED):
                    chunk_events.append(_refusal_event(item))
            report.events.extend(chunk_events)
            try:
                if recorder is not None:
                    _record(recorder, chunk_events)  # as the work happens: an interrupted run keeps these
            finally:
                _DEFER.stop()
            for item in report.results[-len(results):] if results else []:
                if progress is not None:
                    progress(item)
    finally:
        with contextlib.suppress(KeyboardInterrupt):  # an exception in flight wins; the handler is restored
            _DEFER.stop()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return report


class _OutputClaims:
    """Output names (``naming="uid"``) claimed by this run's inputs, so none is silently overwritten.

    Two inputs with the same SOP Instance UID map to the same output name (the keyed UID). Where
    their de-identified bytes are equal (the same object copied twice, common in exports), it is
    written once and the later input is rejected as a duplicate. Where they differ, which one is
    right cannot be told: neither is kept (the file is removed and every input claiming that name
    is quarantined, including one that comes later). Workers rename their files in parallel, so
    the file on disk could be either version until then.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.first: dict[str, tuple[FileResult, str | None]] = {}
        self.conflicted: set[str] = set()

    def settle(self, item: FileResult, digest: str | None) -> list[dict[str, Any]]:
        """Check a written ``item`` against earlier claims; may turn it (and the first claimant)
        into a refusal. Returns the audit events about the first claimant (the caller records
        ``item``'s own event by its outcome)."""
        name = item.output or ""
        first = self.first.get(name)
        if first is None and name not in self.conflicted:
            self.first[name] = (item, digest)
            return []
        if first is not None and digest is not None and digest == first[1]:
            item.outcome = FileOutcome.REJECTED
            item.reason = (f"input #{item.index}: duplicate of input #{first[0].index} (the same object: equal "
                           "de-identified bytes, written once)")
            return []
        events: list[dict[str, Any]] = []
        if first is not None:  # the first claimant's file was written (and recorded): withdraw it
            del self.first[name]
            self.conflicted.add(name)
            claimant = first[0]
            claimant.outcome = FileOutcome.QUARANTINED
            claimant.reason = (f"input #{claimant.index}: input #{item.index} has the same SOP Instance UID with "
                               "different content; neither is written")
            events += [_withdrawn_event(claimant), _refusal_event(claimant)]
        self._remove(name)
        item.outcome = FileOutcome.QUARANTINED
        item.reason = (f"input #{item.index}: another input has the same SOP Instance UID with different content; "
                       "neither is written")
        return events

    def _remove(self, name: str) -> None:
        path = self.root / name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the removal is as durable as the write was
        finally:
            os.close(fd)


def _withdrawn_event(r: FileResult) -> dict[str, Any]:
    return {"action": "deid.write_withdrawn", "resource": f"file:{r.output}", "outcome": "success",
            "details": {"index": r.index, "input_sha256": r.sha256, "output": r.output,
                        "reason": "another input has the same SOP Instance UID with different content"}}


def _policy_event(policy: DicomPolicy, key_id: str, dry_run: bool) -> dict[str, Any]:
    return {"action": "deid.policy_applied", "resource": f"policy:{policy.name}", "outcome": "success", "details": {
        "policy_name": policy.name, "policy_version": policy.policy_version, "policy_digest": policy.digest,
        "options": sorted(policy.option_values), "key_id": key_id, "dry_run": dry_run}}


def _record(audit: Any, events: list[dict[str, Any]]) -> None:
    if not events:
        return
    if hasattr(audit, "append_many"):
        audit.append_many(events)  # one transaction per chunk
    else:
        for e in events:
            audit.record(e["action"], e["resource"], outcome=e["outcome"], details=e["details"])


def record_tree_audit(audit: Any, report: TreeReport, policy: DicomPolicy, key_id: str, *, dry_run: bool) -> None:
    """Append a finished run's audit trail in one go (for callers that did not pass ``audit``)."""
    _record(audit, [_policy_event(policy, key_id, dry_run), *report.events])


# ----------------------------------------------------------------------------- refusal report
def default_refusal_report_path(output: str | os.PathLike[str]) -> Path:
    """``OUT.quarantine.json`` next to ``OUT`` (never inside it: the output folder holds only
    de-identified objects, and a consumer that reads every file there must not meet it)."""
    out = Path(os.path.abspath(output))
    return out.with_name(out.name + ".quarantine.json")


def refusal_fails(quarantined: int, *, allow_quarantine: bool) -> bool:
    """The exit rule of ``securetrain deid`` and of the pipeline: a run fails (exit 65,
    ``RefusedFilesError``) only when files were quarantined (could not be processed: a data
    problem) and that was not accepted. Files the policy rejects on purpose (burned-in text, no
    patient identity) never fail a run; they are reported."""
    return quarantined > 0 and not allow_quarantine


def refusal_report(report: TreeReport, policy: DicomPolicy, *, allow_quarantine: bool) -> dict[str, Any]:
    """The rejected and quarantined inputs of a run: 1-based index in the sorted listing of IN,
    SHA-256 and reason (inputs are never named: file and folder names can carry PHI).

    ``accepted``: the run did not fail for its refusals -- no file was quarantined, or the
    quarantined ones were accepted (``allow_quarantine``). Rejected files alone never fail a run."""
    refused = [r for r in report.results if r.outcome in (FileOutcome.REJECTED, FileOutcome.QUARANTINED)]
    return {
        "format": REFUSAL_REPORT_FORMAT,
        "policy": policy.name,
        "policy_digest": policy.digest,
        "files": len(report.results),
        "written": report.count(FileOutcome.WRITTEN),
        "rejected": report.rejected,
        "quarantined": report.quarantined,
        # no quarantined files, or --allow-quarantine accepted them (exit 0); false: exit 65
        "accepted": not refusal_fails(report.quarantined, allow_quarantine=allow_quarantine),
        "refused": [{"index": r.index, "sha256": r.sha256, "outcome": r.outcome.value,
                     "reason": (r.reason or "").removeprefix(f"input #{r.index}: ")} for r in refused],
    }


def write_refusal_report(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    import json

    from securetrain.io.atomic import atomic_write_bytes

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, json.dumps(data, indent=1).encode() + b"\n", mode=0o600)
    return target


def remove_stale_refusal_report(path: str | os.PathLike[str]) -> bool:
    """Remove a refusal report an earlier run left at ``path`` (only a file in our format), so the
    report next to an output always describes the run that wrote the output."""
    import json

    target = Path(path)
    try:
        data = json.loads(target.read_bytes())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("format") != REFUSAL_REPORT_FORMAT:
        return False
    target.unlink()
    return True

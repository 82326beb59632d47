"""De-identify a folder tree into another folder: the library behind ``securetrain deid``.

``deidentify_tree(src, dst, policy, key, workers=..., audit=..., dry_run=...)`` walks ``src``
recursively (sorted), writes each output to the same relative path under ``dst`` and returns a
:class:`TreeReport` with one :class:`FileResult` per input and a :class:`FileOutcome` each:

* ``written`` / ``would_write`` (dry run) -- de-identified;
* ``rejected`` -- the policy refuses it (e.g. possible burned-in text), with the reason;
* ``quarantined`` -- not readable as DICOM (or truncated), with the reason.

Work goes to ``workers`` processes in chunks; each chunk's files are written with a
:class:`~securetrain.masking.dicom.output.BatchWriter` (one fsync per file plus one per directory
per chunk) and count as written only after the chunk's flush. Audit events of the workers (one
``dicom.read`` per input, with its sha256) come back with the results and are appended by the
caller's recorder in one batch, followed by one ``deid.reject``/``deid.quarantine`` per refusal.
Reasons and reports never carry attribute values.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from securetrain.errors import ConfigError
from securetrain.masking.dicom.policy import DicomPolicy


class FileOutcome(str, Enum):
    WRITTEN = "written"
    WOULD_WRITE = "would_write"
    REJECTED = "rejected"
    QUARANTINED = "quarantined"


@dataclass
class FileResult:
    source: str  # path relative to the input root
    outcome: FileOutcome
    reason: str | None = None
    tags_changed: int = 0
    # dry runs: (tag, keyword, action, nested) per change; never values
    changes: list[tuple[int, str, str, bool]] = field(default_factory=list)


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


def _init_worker(policy: DicomPolicy, key: bytes, record_changes: bool) -> None:
    global _WORKER
    from securetrain.audit.recorder import MemoryAuditRecorder
    from securetrain.masking.dicom.engine import Deidentifier

    # Workers cannot share the parent's database handle: events go back with the results.
    _WORKER = Deidentifier(policy, key, MemoryAuditRecorder(), record_changes=record_changes)


def _process_chunk(chunk: list[tuple[str, str, str | None]]) -> tuple[list[dict[str, Any]], dict[str, str], list]:
    """(results, new pseudonyms, read events) for one chunk of (source, relative name, target)."""
    from securetrain.masking.dicom.errors import BurnedInAnnotationError, DeidError, UnreadableDicomError
    from securetrain.masking.dicom.output import BatchWriter

    before = dict(_WORKER.pseudonyms)
    results: list[dict[str, Any]] = []
    writer = BatchWriter(max_pending=len(chunk) + 1)
    try:
        for src, rel, dst in chunk:
            try:
                report = _WORKER.deidentify_file(src, dst, dry_run=dst is None, writer=writer)
            except UnreadableDicomError as exc:
                results.append({"source": rel, "outcome": "quarantined", "reason": str(exc)})
                continue
            except (BurnedInAnnotationError, DeidError) as exc:
                results.append({"source": rel, "outcome": "rejected", "reason": str(exc)})
                continue
            changes = [(c.tag, c.keyword, c.action, "." in c.path) for c in report.changes] if dst is None else []
            results.append({"source": rel, "outcome": "would_write" if dst is None else "written",
                            "tags_changed": report.tags_changed, "changes": changes})
        writer.flush()  # only now are the chunk's files "written"
    except BaseException:
        writer.abort()
        raise
    events = [e for e in _WORKER.audit.events if e["action"] == "dicom.read"]
    _WORKER.audit.events.clear()
    new = {k: v for k, v in _WORKER.pseudonyms.items() if k not in before}
    return results, new, events


# ----------------------------------------------------------------------------- caller side
def plan_tree(src: Path, dst: Path, *, dry_run: bool) -> list[tuple[str, str, str | None]]:
    """(source, relative name, target or None) for every file below ``src`` (or ``src`` itself)."""
    if not src.exists():
        raise ConfigError(f"input {src} does not exist")
    if src.is_dir():
        if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
            raise ConfigError("OUT must not be IN or inside IN", hint="choose a separate output folder")
        files = sorted(p for p in src.rglob("*") if p.is_file())
        if not files:
            raise ConfigError(f"input folder {src} contains no files", hint="check the path (IN is searched recursively)")
        return [(str(p), str(p.relative_to(src)), None if dry_run else str(dst / p.relative_to(src))) for p in files]
    return [(str(src), src.name, None if dry_run else str(dst))]


def _chunks(tasks: list, workers: int) -> Iterator[list]:
    size = max(1, min(64, len(tasks) // max(1, workers * 4) or 1))
    for i in range(0, len(tasks), size):
        yield tasks[i : i + size]


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
) -> TreeReport:
    """De-identify every file under ``src`` into ``dst`` (same relative paths); see module doc."""
    from securetrain.masking.dicom.keys import DeidKeys

    keys = DeidKeys.from_secret(key)  # validate before any work
    tasks = plan_tree(Path(src), Path(dst), dry_run=dry_run)
    report = TreeReport()
    chunks = list(_chunks(tasks, workers))
    if workers <= 1 or len(chunks) <= 1:
        _init_worker(policy, key, dry_run)
        outputs: Iterator = map(_process_chunk, chunks)
        pool = None
    else:
        import securetrain.masking.dicom.engine  # noqa: F401  -- imported once here, inherited by forked workers

        pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(policy, key, dry_run))
        outputs = pool.map(_process_chunk, chunks)
    try:
        for results, pseudonyms, events in outputs:
            report.pseudonyms.update(pseudonyms)
            report.events.extend(events)
            for r in results:
                item = FileResult(r["source"], FileOutcome(r["outcome"]), r.get("reason"), r.get("tags_changed", 0),
                                  [tuple(c) for c in r.get("changes", [])])
                report.results.append(item)
                if progress is not None:
                    progress(item)
    finally:
        if pool is not None:
            pool.shutdown()
    for r in report.results:
        if r.outcome in (FileOutcome.REJECTED, FileOutcome.QUARANTINED):
            report.events.append({"action": "deid.reject" if r.outcome == FileOutcome.REJECTED else "deid.quarantine",
                                  "resource": "input", "outcome": "refused",
                                  "details": {"reason": (r.reason or "")[:200]}})
    if audit is not None:
        record_tree_audit(audit, report, policy, keys.key_id, dry_run=dry_run)
    return report


def record_tree_audit(audit: Any, report: TreeReport, policy: DicomPolicy, key_id: str, *, dry_run: bool) -> None:
    """Append a run's audit trail: the policy applied, then every read and refusal in one batch."""
    audit.record("deid.policy_applied", f"policy:{policy.name}", details={
        "policy_name": policy.name, "policy_version": policy.policy_version, "policy_digest": policy.digest,
        "options": sorted(policy.option_values), "key_id": key_id, "dry_run": dry_run})
    if hasattr(audit, "append_many"):
        audit.append_many(report.events)  # one transaction for the whole run
    else:
        for e in report.events:
            audit.record(e["action"], e["resource"], outcome=e["outcome"], details=e["details"])

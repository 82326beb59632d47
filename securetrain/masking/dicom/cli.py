"""``securetrain deid``: de-identify a DICOM file or folder tree with a policy.

Only typer/rich/stdlib at import time (``--help`` stays fast); pydicom loads inside the command.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from securetrain.audit.cli_support import AUDIT_DB_OPTION

_WORKER: Any = None


def _init_worker(policy_path: str, secret: bytes) -> None:
    global _WORKER
    from securetrain.audit.recorder import MemoryAuditRecorder
    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.policy import load_policy

    # Workers cannot share the parent's database handle: they keep events in memory and hand
    # them back with each result; the parent appends them to the audit log.
    _WORKER = Deidentifier(load_policy(policy_path), secret, MemoryAuditRecorder(), record_changes=True)


def _take_read_events() -> list[dict[str, Any]]:
    events = [e for e in _WORKER.audit.events if e["action"] == "dicom.read"]
    _WORKER.audit.events.clear()
    return events


def _process(task: tuple[str, str | None, bool]) -> dict[str, Any]:
    """Runs in a worker: returns status, a value-free report and the pseudonyms it assigned."""
    from securetrain.masking.dicom.errors import BurnedInAnnotationError, DeidError, UnreadableDicomError

    src, dst, dry_run = task
    before = dict(_WORKER.pseudonyms)
    try:
        report = _WORKER.deidentify_file(src, dst, dry_run=dry_run)
    except UnreadableDicomError as exc:
        return {"src": src, "status": "quarantined", "reason": str(exc), "events": _take_read_events()}
    except BurnedInAnnotationError as exc:
        return {"src": src, "status": "rejected", "reason": str(exc), "events": _take_read_events()}
    except DeidError as exc:
        return {"src": src, "status": "rejected", "reason": str(exc), "events": _take_read_events()}
    new = {k: v for k, v in _WORKER.pseudonyms.items() if k not in before}
    changes = [(c.tag, c.keyword, c.action, "." in c.path) for c in report.changes] if dry_run else []
    return {"src": src, "status": "ok", "tags_changed": report.tags_changed, "changes": changes, "pseudonyms": new,
            "events": _take_read_events()}


def _read_key(key_file: Path | None, what: str, env: str | None) -> bytes:
    from securetrain.masking.dicom.errors import DeidKeyError
    from securetrain.masking.dicom.keys import parse_key_text

    if key_file is not None:
        try:
            return parse_key_text(key_file.read_bytes(), what=str(key_file))
        except OSError as exc:
            raise DeidKeyError(f"cannot read {what} file {key_file}: {exc.strerror}") from None
    if env and os.environ.get(env):
        return parse_key_text(os.environ[env].encode(), what=env, hex_only=True)
    raise DeidKeyError(f"no {what}: pass --key-file" + (f" or set {env} (hex)" if env else ""))


def deid(
    input_path: Path = typer.Argument(..., metavar="IN", help="A DICOM file or a folder (searched recursively)."),
    output_path: Path = typer.Argument(..., metavar="OUT", help="Output file (for one input file) or folder."),
    policy: Path = typer.Option(..., "--policy", "-p", help="Policy file, e.g. policies/dicom-basic.yaml."),
    key_file: Path | None = typer.Option(None, "--key-file", help="Project secret (hex or raw). Default: $SECURETRAIN_DEID_KEY (hex)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Report per tag what would change (never values); write nothing."),
    workers: int = typer.Option(1, "--workers", "-j", min=1, help="Worker processes."),
    mapping_out: Path | None = typer.Option(None, "--mapping-out", help="Write the encrypted id->pseudonym mapping here."),
    mapping_key_file: Path | None = typer.Option(None, "--mapping-key-file", help="32-byte AES key (hex or raw) for --mapping-out."),
    audit_db: str | None = AUDIT_DB_OPTION,
) -> None:
    """De-identify DICOM per PS3.15 Annex E with a policy; rich progress, summary table."""
    from concurrent.futures import ProcessPoolExecutor

    from rich.table import Table

    from securetrain.audit.cli_support import command_recorder
    from securetrain.cli.console import console, progress_bar
    from securetrain.errors import ConfigError
    from securetrain.masking.dicom.keys import ENV_KEY, DeidKeys
    from securetrain.masking.dicom.mapping import export_mapping
    from securetrain.masking.dicom.policy import load_policy

    pol = load_policy(policy)  # validate before any work
    secret = _read_key(key_file, "de-identification key", ENV_KEY)
    DeidKeys.from_secret(secret)
    mapping_key = None
    if mapping_out is not None:
        mapping_key = _read_key(mapping_key_file, "mapping key", None)
    if not input_path.exists():
        raise ConfigError(f"input {input_path} does not exist")
    if input_path.is_dir():
        sources = sorted(p for p in input_path.rglob("*") if p.is_file())
        if output_path.resolve() == input_path.resolve() or input_path.resolve() in output_path.resolve().parents:
            raise ConfigError("OUT must not be IN or inside IN", hint="choose a separate output folder")
        tasks = [(str(p), str(output_path / p.relative_to(input_path)), dry_run) for p in sources]
    else:
        tasks = [(str(input_path), str(output_path), dry_run)]

    results: list[dict[str, Any]] = []
    with progress_bar() as progress:
        bar = progress.add_task("de-identifying" if not dry_run else "dry run", total=len(tasks), status="")
        if workers == 1:
            _init_worker(str(policy), secret)
            iterator = map(_process, tasks)
            pool = None
        else:
            pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(str(policy), secret))
            iterator = pool.map(_process, tasks, chunksize=max(1, len(tasks) // (workers * 8)))
        try:
            for res in iterator:
                results.append(res)
                bad = sum(r["status"] != "ok" for r in results)
                progress.update(bar, advance=1, status=f"{bad} not written" if bad else "")
        finally:
            if pool is not None:
                pool.shutdown()

    ok = [r for r in results if r["status"] == "ok"]
    rejected = [r for r in results if r["status"] == "rejected"]
    quarantined = [r for r in results if r["status"] == "quarantined"]

    if dry_run:
        agg: dict[tuple[int, str, str], list[int]] = {}
        for r in ok:
            seen: set[tuple[int, str, str]] = set()
            for tag, keyword, action, nested in r["changes"]:
                k = (tag, keyword, action)
                entry = agg.setdefault(k, [0, 0])
                if k not in seen:
                    entry[0] += 1
                    seen.add(k)
                entry[1] += int(nested)
        table = Table(title="would change (per tag; values never shown)")
        for col in ("tag", "keyword", "action", "files", "nested occurrences"):
            table.add_column(col, overflow="fold")
        for (tag, keyword, action), (files, nested) in sorted(agg.items()):
            table.add_row(f"({tag >> 16:04X},{tag & 0xFFFF:04X})", keyword, action, str(files), str(nested))
        console.print(table)

    for r in rejected + quarantined:
        console.print(f"[yellow]{r['status']}[/]: {Path(r['src']).name}: {r['reason']}", highlight=False)

    with command_recorder(audit_db) as audit:
        audit.record("deid.policy_applied", f"policy:{pol.name}", details={
            "policy_name": pol.name, "policy_version": pol.policy_version, "policy_digest": pol.digest,
            "options": sorted(pol.option_values), "key_id": DeidKeys.from_secret(secret).key_id, "dry_run": dry_run})
        events = [e for r in results for e in r.get("events", [])]
        for r in rejected + quarantined:
            events.append({"action": f"deid.{'reject' if r['status'] == 'rejected' else 'quarantine'}",
                           "resource": "input", "outcome": "refused", "details": {"reason": r["reason"][:200]}})
        if hasattr(audit, "append_many"):
            audit.append_many(events)  # one transaction for the whole run
        else:
            for e in events:
                audit.record(e["action"], e["resource"], outcome=e["outcome"], details=e["details"])

    summary = Table(title=f"de-identification summary (policy {pol.name})")
    for col in ("files", "written" if not dry_run else "would write", "tags changed", "rejected", "quarantined"):
        summary.add_column(col, justify="right")
    summary.add_row(
        str(len(results)), str(len(ok)), str(sum(r["tags_changed"] for r in ok)), str(len(rejected)), str(len(quarantined))
    )
    console.print(summary)

    if mapping_out is not None and mapping_key is not None and not dry_run:
        mapping: dict[str, str] = {}
        for r in ok:
            mapping.update(r["pseudonyms"])
        export_mapping(mapping_out, mapping, mapping_key)
        console.print(f"encrypted pseudonym mapping ({len(mapping)} entries) written to {mapping_out}")


def register(app: typer.Typer) -> None:
    app.command("deid")(deid)

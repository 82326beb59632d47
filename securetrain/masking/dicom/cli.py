"""``securetrain deid``: de-identify a DICOM file or folder tree with a policy.

Only typer/rich/stdlib at import time (``--help`` stays fast); pydicom loads inside the command.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import typer

from securetrain.audit.cli_support import AUDIT_DB_OPTION
from securetrain.masking.dicom.errors import REFUSED_FILES_EXIT_CODE as REFUSED_EXIT


def _read_key(key_file: Path | None, what: str, env: str | None) -> bytes:
    from securetrain.keytext import check_key_file_mode
    from securetrain.masking.dicom.errors import DeidKeyError
    from securetrain.masking.dicom.keys import parse_key_text

    if key_file is not None:
        try:
            data = key_file.read_bytes()
        except OSError as exc:
            raise DeidKeyError(f"cannot read {what} file {key_file}: {exc.strerror}") from None
        check_key_file_mode(key_file)
        return parse_key_text(data, what=f"{what} file {key_file}")
    if env and os.environ.get(env):
        return parse_key_text(os.environ[env].encode(), what=env, hex_only=True)
    raise DeidKeyError(f"no {what}: pass --key-file" + (f" or set {env} (hex)" if env else ""))


def deid(
    input_path: Path = typer.Argument(..., metavar="IN", help="A DICOM file or a folder (searched recursively)."),
    output_path: Path = typer.Argument(..., metavar="OUT", help="Output file (for one input file) or folder."),
    policy: Path = typer.Option(..., "--policy", "-p", help="Policy file, e.g. policies/dicom-basic.yaml."),
    key_file: Path | None = typer.Option(None, "--key-file", help="Project secret: 64 hex chars, hex:..., base64:... or 32 raw bytes (mode 0600). Default: $SECURETRAIN_DEID_KEY."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Report per tag what would change (never values); write nothing."),
    workers: int = typer.Option(1, "--workers", "-j", min=1, help="Worker processes."),
    mapping_out: Path | None = typer.Option(None, "--mapping-out", help="Write the encrypted id->pseudonym mapping here."),
    mapping_key_file: Path | None = typer.Option(None, "--mapping-key-file", help="32-byte AES key (64 hex chars, hex:..., base64:... or 32 raw bytes) for --mapping-out."),
    keep_paths: bool = typer.Option(False, "--keep-paths", help="Name outputs by their input paths instead of the new "
                                    "SOP Instance UID (only if no file or folder name carries PHI)."),
    allow_quarantine: bool = typer.Option(False, "--allow-quarantine", help="Accept partial output: exit 0 even "
                                          "when files were quarantined (unreadable, truncated, not DICOM; default: "
                                          f"exit {REFUSED_EXIT}). Files the policy rejects never change the exit "
                                          "status."),
    quarantine_report: Path | None = typer.Option(None, "--quarantine-report", help="Where to write the JSON "
                                                  "report of rejected/quarantined inputs (index, sha256, reason; "
                                                  "never names). Default: OUT.quarantine.json next to OUT."),
    audit_db: str | None = AUDIT_DB_OPTION,
) -> None:
    """De-identify DICOM per PS3.15 Annex E with a policy; rich progress, summary table.

    Exit status: 0 no input was quarantined (files the policy rejects -- burned-in text, no patient
    identity -- are listed in the refusal report and a yellow line, and do not fail the run), or
    --allow-quarantine; 65 some inputs were quarantined (unreadable, truncated, not DICOM,
    corrupt): the output is partial, a red line names the counts and the report file; 2 usage,
    key or policy errors (nothing done); 130 interrupted. A dry run exits the same way (no report).
    """
    from rich.table import Table

    from securetrain.audit.cli_support import command_recorder
    from securetrain.cli.console import console, err_console, progress_bar
    from securetrain.masking.dicom.keys import ENV_KEY, DeidKeys
    from securetrain.masking.dicom.policy import load_policy
    from securetrain.masking.dicom.tree import (
        FileOutcome,
        FileResult,
        default_refusal_report_path,
        deidentify_tree,
        plan_tree,
        refusal_fails,
        refusal_report,
        remove_stale_refusal_report,
        write_refusal_report,
    )

    pol = load_policy(policy)  # validate before any work
    secret = _read_key(key_file, "de-identification key", ENV_KEY)
    DeidKeys.from_secret(secret)
    mapping_key = None
    if mapping_out is not None:
        mapping_key = _read_key(mapping_key_file, "mapping key", None)
    total = len(plan_tree(input_path, output_path, dry_run=True))  # also validates IN/OUT

    with contextlib.ExitStack() as stack, progress_bar() as progress:
        bar = progress.add_task("de-identifying" if not dry_run else "dry run", total=total, status="")
        refused = 0

        def advance(result: FileResult) -> None:
            nonlocal refused
            refused += result.outcome in (FileOutcome.REJECTED, FileOutcome.QUARANTINED)
            progress.update(bar, advance=1, status=f"{refused} not written" if refused else "")

        # The audit log opens once the worker processes exist (they never inherit its database
        # handle); events are recorded per chunk as work happens.
        report = deidentify_tree(input_path, output_path, pol, secret, workers=workers, dry_run=dry_run,
                                 progress=advance, naming="path" if keep_paths else "uid",
                                 audit=lambda: stack.enter_context(command_recorder(audit_db)))
    if dry_run:
        agg: dict[tuple[int, str, str], list[int]] = {}
        for r in report.results:
            seen: set[tuple[int, str, str]] = set()
            for tag, keyword, action, in_sequence in r.changes:
                k = (tag, keyword, action)
                entry = agg.setdefault(k, [0, 0])
                if k not in seen:
                    entry[0] += 1
                    seen.add(k)
                entry[1] += int(in_sequence)
        table = Table(title="would change (per tag; values never shown)")
        for col in ("tag", "keyword", "action", "files", "nested occurrences"):
            table.add_column(col, overflow="fold")
        for (tag, keyword, action), (n_files, n_nested) in sorted(agg.items()):
            table.add_row(f"({tag >> 16:04X},{tag & 0xFFFF:04X})", keyword, action, str(n_files), str(n_nested))
        console.print(table)

    for r in report.results:  # by index and digest: input file names may carry PHI
        if r.outcome in (FileOutcome.REJECTED, FileOutcome.QUARANTINED):
            digest = f" (sha256 {r.sha256[:16]})" if r.sha256 else ""
            reason = (r.reason or "").removeprefix(f"input #{r.index}: ")
            console.print(f"[yellow]{r.outcome.value}[/]: input #{r.index}{digest}: {reason}", highlight=False)

    summary = Table(title=f"de-identification summary (policy {pol.name})")
    for col in ("files", "written" if not dry_run else "would write", "tags changed", "rejected", "quarantined"):
        summary.add_column(col, justify="right")
    summary.add_row(str(len(report.results)), str(report.written), str(report.tags_changed), str(report.rejected),
                    str(report.quarantined))
    console.print(summary)

    if mapping_out is not None and mapping_key is not None and not dry_run:
        from securetrain.masking.dicom.mapping import export_mapping

        files = {r.source: r.output for r in report.results if r.output}
        export_mapping(mapping_out, report.pseudonyms, mapping_key, files=files)
        console.print(f"encrypted mapping ({len(report.pseudonyms)} pseudonyms, {len(files)} file names) "
                      f"written to {mapping_out}")

    # Quarantined files (a data problem) must not look like success to a scheduler: exit 65 unless
    # accepted. Rejected files are the policy working: reported (yellow line, report), exit 0.
    refused = report.rejected + report.quarantined
    report_path = quarantine_report or default_refusal_report_path(output_path)
    if not dry_run:
        if refused:
            write_refusal_report(report_path, refusal_report(report, pol, allow_quarantine=allow_quarantine))
        else:
            remove_stale_refusal_report(report_path)  # the report next to OUT describes this run
    if not refused:
        return
    what = (f"{refused} of {len(report.results)} input files {'would not be' if dry_run else 'not'} written "
            f"({report.rejected} rejected, {report.quarantined} quarantined)")
    where = "dry run: no report written" if dry_run else f"report: {report_path}"
    if refusal_fails(report.quarantined, allow_quarantine=allow_quarantine):
        err_console.print(f"[bold red]incomplete:[/] {what}; {where}. Exit {REFUSED_EXIT}: quarantined files could "
                          "not be processed; fix or remove them, or pass --allow-quarantine to accept partial output.",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(REFUSED_EXIT)
    if report.quarantined:
        console.print(f"[yellow]partial output accepted (--allow-quarantine):[/] {what}; {where}", highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"[yellow]rejected by the policy:[/] {what}; {where}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("deid")(deid)

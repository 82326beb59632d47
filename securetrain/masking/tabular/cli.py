"""``securetrain mask IN OUT --policy P``: mask a CSV/Parquet table with a keyed policy."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import typer

from securetrain.audit.cli_support import AUDIT_DB_OPTION

KEY_ENV = "SECURETRAIN_MASK_KEY"


def _load_key(key_file: Path | None) -> bytes:
    from securetrain.keytext import decode_key
    from securetrain.masking.tabular.errors import MaskKeyError

    if key_file is not None:
        try:
            st = key_file.stat()
            raw = key_file.read_bytes()
        except OSError:
            raise MaskKeyError(f"cannot read key file {key_file}", hint="check the path and permissions") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise MaskKeyError(f"key file {key_file} is readable by group/others",
                               hint=f"chmod 600 {key_file}")
        return decode_key(raw, what=f"key file {key_file}", error=MaskKeyError, allow_raw=True)
    env = os.environ.get(KEY_ENV)
    if env is None:
        raise MaskKeyError("no masking key given",
                           hint=f"pass --key-file F or set {KEY_ENV} to a hex key (64 hex chars)")
    return decode_key(env, what=KEY_ENV, error=MaskKeyError)


def mask_command(
    src: Path = typer.Argument(..., help="input table (.csv, .parquet, .pq)"),
    dst: Path = typer.Argument(..., help="output table (.csv, .parquet, .pq); replaced atomically"),
    policy: Path = typer.Option(Path("finance-pii"), "--policy", "-p",
                                help="masking policy YAML, or a shipped policy's name (default: finance-pii)"),
    key_file: Path | None = typer.Option(None, "--key-file", help=f"key file, mode 0600 (64 hex chars, hex:..., base64:... or 32 raw bytes); else ${KEY_ENV}"),
    report_json: Path | None = typer.Option(None, "--report-json", help="also write the report (counts only) as JSON"),
    audit_db: str | None = AUDIT_DB_OPTION,
) -> None:
    """Mask PII columns of a table according to a policy (fail closed on unknown columns)."""
    import json

    from rich.table import Table

    from securetrain.audit.cli_support import command_recorder
    from securetrain.cli.console import console, progress_bar
    from securetrain.io.atomic import atomic_write_bytes
    from securetrain.masking.tabular.masker import TabularMasker

    with command_recorder(audit_db) as audit, progress_bar(transient=True) as bar:
        masker = TabularMasker(policy, _load_key(key_file), audit=audit)
        task = bar.add_task("masking", total=None, status="reading")

        def tick(column: str) -> None:
            bar.update(task, advance=1, status=column)

        report = masker.mask_file(src, dst, on_column=tick)
    table = Table(title=f"{src.name} -> {dst.name}: {report.rows} rows, policy {report.policy_name} "
                        f"v{report.policy_version}, key {report.key_id}")
    for col in ("column", "action", "rule", "nulls", "invalid", "distinct", "detections"):
        table.add_column(col, overflow="fold")
    for c in report.columns:
        det = ", ".join(f"{k}={v}" for k, v in sorted(c.detections.items()))
        table.add_row(c.column, c.action, c.rule, str(c.nulls), str(c.invalid),
                      "" if c.distinct is None else str(c.distinct), det)
    console.print(table)
    console.print(f"policy digest {report.policy_digest}\noutput sha256 {report.output_sha256}", highlight=False)
    if report.csv_formula_guard is not None:
        console.print(f"csv formula guard {report.csv_formula_guard}: {report.formula_cells_escaped} cell(s) "
                      "escaped with a leading '", highlight=False)
    if report_json is not None:
        atomic_write_bytes(report_json, json.dumps(report.to_dict(), indent=1).encode())


def synth_command(
    dst: Path = typer.Argument(..., help="output table (.csv or .parquet)"),
    rows: int = typer.Option(1000, "--rows", min=1),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Write a synthetic finance table full of fake PII (for demos and tests)."""
    from securetrain.masking.tabular.synthetic import write_finance_file

    write_finance_file(dst, rows, seed=seed)
    typer.echo(f"wrote {rows} synthetic rows to {dst}")


def register(app: typer.Typer) -> None:
    app.command("mask")(mask_command)
    app.command("mask-synth")(synth_command)

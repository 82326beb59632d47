"""``securetrain run CONFIG`` and ``securetrain demo``: the whole pipeline."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

DEMO_CONFIG = "examples/demo.yaml"


def _load_flow():
    """Import ``flows/secure_training.py`` from the project tree (flows are not package modules)."""
    from securetrain.pipeline.locate import find_project_file

    flows_dir = find_project_file("flows/secure_training.py").parent
    root = str(flows_dir.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from flows.secure_training import secure_training

    return secure_training


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _print_result(result) -> None:  # noqa: ANN001 - PipelineResult
    from rich.markup import escape
    from rich.table import Table

    from securetrain.cli.console import console

    table = Table(title=f"securetrain run: {result.run_dir}", show_header=True, header_style="bold")
    table.add_column("stage")
    table.add_column("result")
    table.add_column("where", overflow="fold")
    d, m, t = result.deid, result.masking, result.training
    if d:
        table.add_row("de-identification", f"{d.files_out}/{d.files_in} files, {d.tags_changed} tags changed, "
                      f"{d.rejected} rejected, {d.quarantined} quarantined"
                      + (f" ([yellow]{escape(d.refusal_note())}[/])" if d.refusal_report else ""),
                      str(d.refusal_report or d.output_dir))
    if m:
        table.add_row("masking", f"{m.rows_in} rows, policy {m.policy} v{m.policy_version}, split by {m.split_by}: "
                      f"{m.train_entities}/{m.eval_entities} entities", str(m.output_dir))
    last = t.checkpoints[-1] if t.checkpoints else None
    outputs = "regression (one output)" if t.task_kind == "regression" else f"{len(t.class_names)} classes"
    table.add_row("model", f"{t.model_target}: {t.parameters:,} parameters, {outputs}", "")
    table.add_row("training", f"{t.steps} steps on {t.device}, final loss {t.final_loss:.3g} ({t.reason})",
                  str(last.path.parent) if last else "-")
    if t.validation:
        from securetrain.pipeline.report import best_validation

        b = best_validation(t) or {}
        scores = (f"RMSE {_fmt(b.get('rmse'))}, MAE {_fmt(b.get('mae'))}, R² {_fmt(b.get('r2'))}"
                  if t.task_kind == "regression" else
                  f"accuracy {_fmt(b.get('accuracy'))}, macro AUC {_fmt(b.get('auc'))}, loss {_fmt(b.get('loss'))}")
        table.add_row("validation", f"best epoch {b.get('epoch')}: {scores}",
                      str(t.best_checkpoint.path) if t.best_checkpoint else "-")
    if last:
        table.add_row("encrypted checkpoint", f"step {last.step}, key id {last.key_id}", str(last.path))
    if result.he:
        h = result.he
        scores = (f"RMSE {_fmt(h.rmse_encrypted)} (plaintext {_fmt(h.rmse_plaintext)})"
                  if h.task_kind == "regression" else
                  f"AUC {_fmt(h.encrypted_auc)} (plaintext {_fmt(h.plaintext_auc)}), same prediction "
                  f"{_fmt(h.prediction_agreement)}")
        table.add_row("HE evaluation (CKKS)", f"{h.samples} samples, max abs err {h.max_abs_error:.1e}, {scores}",
                      f"N={h.poly_modulus_degree}")
    if result.audit:
        a = result.audit
        verdict = "[green]verified[/]" if a.verified else "[red]FAILED[/]"
        table.add_row("audit log", f"{a.entries} entries, standalone verifier: {verdict}", a.url)
        table.add_row("audit export", f"root {a.root_hash[:16]}…", str(a.export_dir))
    table.add_row("training curve", "PNG", str(result.curve_png))
    table.add_row("run report", "HTML", str(result.report_html))
    table.add_row("run result", "JSON", str(result.result_json))
    console.print(table)


def _run(config_path: Path | None, *, use_prefect: bool, overrides: dict | None = None, new_run: bool = False) -> None:
    from securetrain.pipeline.config import load_pipeline_config
    from securetrain.pipeline.results import PipelineResult
    from securetrain.pipeline.runner import run_pipeline
    from securetrain.pipeline.stages import PREEMPTED_EXIT_CODE, PipelinePreempted

    config = load_pipeline_config(config_path, data=overrides)  # validate before starting Prefect
    from securetrain.pipeline.stages import preflight

    preflight(config)  # model.target / task.target resolve, or one line and nothing written
    from securetrain.cli.heap import freeze_long_lived

    freeze_long_lived()  # torch and the config are loaded: keep the collector off them from here on
    try:
        if use_prefect:
            os.environ.setdefault("DO_NOT_TRACK", "1")
            os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
            # The local ephemeral server needs 15-25 s on a busy 2-core machine; Prefect waits 20.
            os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
            flow = _load_flow()
            freeze_long_lived()  # and off Prefect's modules
            from securetrain.pipeline.prefect_server import start_temporary_server, uses_temporary_server

            if uses_temporary_server():
                start_temporary_server()  # own session: Ctrl-C stops the pipeline, not its server
            result = PipelineResult.model_validate(
                flow(config_path=str(config_path) if config_path else None, overrides=overrides, new_run=new_run)
            )
        else:
            if new_run:
                from securetrain.pipeline.schedule import scheduled_run_config

                config = scheduled_run_config(config)
            result = run_pipeline(config, show_progress=True)
    except PipelinePreempted as exc:
        from securetrain.cli.console import err_console

        err_console.print(f"[yellow]{exc}[/]", soft_wrap=True, highlight=False)
        raise typer.Exit(getattr(exc, "exit_code", PREEMPTED_EXIT_CODE)) from None
    _print_result(result)
    if result.audit and not result.audit.verified:
        raise typer.Exit(1)


def run(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="Pipeline config (YAML/TOML)."),
    no_prefect: bool = typer.Option(False, "--no-prefect", help="Run as a plain library call, without Prefect."),
    new_run: bool = typer.Option(False, "--new-run", help="A run of a series (as schedules do): its own folder "
                                 "<name>-<UTC time>, and the report lists inputs new since the previous one."),
) -> None:
    """Run the secure training pipeline (through Prefect by default)."""
    _run(config, use_prefect=not no_prefect, new_run=new_run)


def demo(
    no_prefect: bool = typer.Option(False, "--no-prefect", help="Run as a plain library call, without Prefect."),
    fresh: bool = typer.Option(True, "--fresh/--resume", help="Start from an empty runs/demo (default)."),
) -> None:
    """End-to-end demo on embedded defaults: synthetic DICOM, CPU, SQLite, local Prefect."""
    import shutil

    from securetrain.pipeline.locate import find_project_file

    config_path = find_project_file(DEMO_CONFIG, required=False)
    overrides = None if config_path else _embedded_demo_defaults()
    if fresh:
        from securetrain.pipeline.config import load_pipeline_config

        run_dir = load_pipeline_config(config_path, data=overrides).run_dir
        if run_dir.exists():
            shutil.rmtree(run_dir)
    _run(config_path, use_prefect=not no_prefect, overrides=overrides)


def _embedded_demo_defaults() -> dict:
    """The demo config when examples/demo.yaml is not around (e.g. an installed wheel)."""
    return {"name": "demo", "secrets": {"create_demo_secrets": True, "demo_deid_key": "fixed"},
            "training": {"epochs": 6, "batch_size": 16, "lr": 0.01, "checkpoint_every": 10}}


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("demo")(demo)

"""``securetrain train [CONFIG]``: train the built-in MLP on synthetic data on the resolved device."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer


def train(
    config: Optional[Path] = typer.Argument(None, help="YAML/TOML with training/data/model sections."),
    device: Optional[str] = typer.Option(None, "--device", "-d", help="auto, cpu, cuda[:N], br, or a plugin name."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Where checkpoints go."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1),
    precision: Optional[str] = typer.Option(None, "--precision", help="auto, bf16, fp16 or fp32."),
    no_resume: bool = typer.Option(False, "--no-resume", help="Ignore existing checkpoints and start over."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (no progress bar)."),
) -> None:
    """Train a small model on a built-in synthetic dataset; SIGTERM checkpoints and exits 75."""
    from securetrain.cli.console import console
    from securetrain.config.loader import load_model
    from securetrain.training.progress import RichProgressCallback
    from securetrain.training.run_config import TrainRunConfig
    from securetrain.training.synthetic import SyntheticClassification, make_mlp
    from securetrain.training.trainer import Trainer

    overrides: dict[str, object] = {}
    for key, value in (("device", device), ("output_dir", str(output_dir) if output_dir else None),
                       ("epochs", epochs), ("max_steps", max_steps), ("precision", precision)):
        if value is not None:
            overrides[key] = value
    if no_resume:
        overrides["resume"] = False
    run = load_model(TrainRunConfig, config, data={"training": overrides} if overrides else None)
    if run.training.max_steps is not None and epochs is None and "epochs" not in overrides and config is None:
        run.training.epochs = None  # --max-steps alone means "run exactly that many steps"
    d = run.data
    dataset = SyntheticClassification(d.samples, d.features, d.classes, seed=d.seed, noise=d.noise)
    model = make_mlp(d.features, d.classes, hidden=run.model.hidden, dropout=run.model.dropout, seed=run.training.seed)
    callbacks = [] if as_json else [RichProgressCallback("train")]
    result = Trainer(model, dataset, run.training, callbacks=callbacks).fit()

    info = result.checkpoint
    summary = {
        "reason": result.reason, "steps": result.steps, "final_loss": result.final_loss, "device": result.device,
        "precision": result.precision, "resumed_from": result.resumed_from,
        "checkpoint": str(info.path) if info else None, "sha256": info.sha256 if info else None,
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        console.print(f"{result.reason}: {result.steps} steps on {result.device} ({result.precision}), final loss {loss}")
        if info:
            console.print(f"checkpoint: {info.path}  sha256 {info.sha256}", highlight=False, soft_wrap=True)
        if result.reason == "preempted":
            console.print("preempted: run the same command again to resume", style="yellow")
    if result.exit_code:
        sys.stdout.flush()
        raise typer.Exit(result.exit_code)


def register(app: typer.Typer) -> None:
    app.command("train")(train)

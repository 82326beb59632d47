"""``securetrain train``: config file + flags, JSON result, resume, typed errors -> exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from securetrain.cli.main import app
from securetrain.errors import ConfigError
from securetrain.training import SafetensorsCheckpointStore


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from securetrain.cli.main import main; main()", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_train_with_config_resume_and_json(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"training: {{epochs: 2, batch_size: 32, output_dir: {tmp_path / 'out'}, checkpoint_every: 3}}\n"
        "data: {samples: 256, features: 8, classes: 3}\nmodel: {hidden: 16}\n"
    )
    runner = CliRunner()
    r = runner.invoke(app, ["train", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    first = json.loads(r.output.strip().splitlines()[-1])
    assert first["reason"] == "completed" and first["steps"] == 16 and first["resumed_from"] is None
    store = SafetensorsCheckpointStore(tmp_path / "out" / "checkpoints")
    assert store.latest().sha256 == first["sha256"] and Path(first["checkpoint"]) == store.latest().path
    r = runner.invoke(app, ["train", str(cfg), "--json", "--epochs", "3"])
    again = json.loads(r.output.strip().splitlines()[-1])
    assert again["resumed_from"] == 16 and again["steps"] == 24


def test_train_table_output_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["train", "--max-steps", "3", "-o", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "checkpoint:" in r.output and "step-00000003.safetensors" in r.output
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("training: {lr: -1}\n")
    r = runner.invoke(app, ["train", str(cfg)])
    assert isinstance(r.exception, ConfigError) and "training.lr" in str(r.exception)
    # The real entry point turns typed errors into one red line and exit code 2.
    bad = _cli("train", "--device", "nope", "-o", str(tmp_path / "o2"))
    assert bad.returncode == 2 and "unknown device backend" in bad.stderr and "Traceback" not in bad.stderr

"""`securetrain demo` / `securetrain run` as a user runs them (README command 1, minus Prefect)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from securetrain.cli.main import app

from .pipeline_fixtures import small_config_data

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")


def test_demo_runs_end_to_end_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples/ and policies/ are found through the source tree
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_KEK", "SECURETRAIN_DEID_KEY"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(app, ["demo", "--no-prefect"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "runs" / "demo"
    assert "verified" in result.output and "report.html" in result.output
    assert (run_dir / "report.html").is_file() and (run_dir / "training-curve.png").is_file()
    assert list((run_dir / "checkpoints").glob("step-*.stenc"))
    assert (run_dir / "keys").stat().st_mode & 0o077 == 0  # demo secrets are owner-only


def test_run_refuses_an_invalid_config_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(small_config_data(tmp_path, training={"batch_size": -1})))
    result = CliRunner().invoke(app, ["run", str(config), "--no-prefect"])
    assert result.exit_code != 0
    assert "training.batch_size" in str(result.exception)
    assert not (tmp_path / "runs").exists()

"""The root command: every capability registered, fast --help, typed errors as one line."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from securetrain.cli.main import app

COMMANDS = {"devices", "train", "deid", "mask", "checkpoint", "keys", "audit", "he", "run", "demo"}


def test_every_capability_registers_its_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    missing = {c for c in COMMANDS if f" {c} " not in result.output}
    assert not missing, missing


def test_help_does_not_import_heavy_libraries() -> None:
    code = "import sys, securetrain.cli.main; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for heavy in ("torch", "pydicom", "pyarrow", "tenseal", "prefect", "sqlalchemy"):
        assert f"'{heavy}'" not in loaded, f"{heavy} is imported by `securetrain --help`"


def test_typed_errors_are_one_line_with_exit_code_2(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from securetrain.cli.main import main; main()", "audit", "verify", "--db",
         str(tmp_path / "missing.db")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout

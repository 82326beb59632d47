"""The root command: every capability registered, fast --help, typed errors as one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
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


def _cli(*args: str, env: dict | None = None, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:  # noqa: ANN001
    import os

    return subprocess.run(
        [sys.executable, "-c", "from securetrain.cli.main import main; main()", *args],
        capture_output=True, text=True, stdin=stdin, env={**os.environ, **(env or {})}, timeout=120,
    )


def test_os_errors_are_one_line_with_a_hint_and_exit_code_2(tmp_path) -> None:
    """A file where a folder is needed: one line, a hint, exit 2 (not a traceback)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    proc = _cli("train", "--output-dir", str(blocker / "out"), "--max-steps", "1", "--json")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "hint:" in lines[0], proc.stderr


def test_describe_os_error_covers_full_disk_and_read_only() -> None:
    import errno

    from securetrain.cli.oserrors import describe_os_error

    full = describe_os_error(OSError(errno.ENOSPC, "No space left on device", "/out/x.dcm"))
    assert full.startswith("No space left on device: /out/x.dcm") and "free disk space" in full
    ro = describe_os_error(OSError(errno.EROFS, "Read-only file system", "/ro/x"))
    assert "read-only" in ro and "\n" not in ro
    assert "hint" not in describe_os_error(OSError(errno.EXDEV, "Invalid cross-device link"))


def test_keyring_without_terminal_names_the_variable(tmp_path) -> None:
    """No TTY and no passphrase variable: no prompt, no "Aborted.", the variable to set."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SECURETRAIN_KEYRING")}
    proc = subprocess.run(
        [sys.executable, "-c", "from securetrain.cli.main import main; main()", "keys", "init", "--keyring",
         str(tmp_path / "k.json")], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "SECURETRAIN_KEYRING_PASSPHRASE" in proc.stderr and "Aborted" not in proc.stderr
    assert not (tmp_path / "k.json").exists()


def test_empty_input_folder_says_so(tmp_path) -> None:
    (tmp_path / "in").mkdir()
    key = tmp_path / "k"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    proc = _cli("deid", str(tmp_path / "in"), str(tmp_path / "out"), "--policy", "policies/dicom-basic.yaml",
                "--key-file", str(key))
    assert proc.returncode == 2, proc.stderr
    assert "contains no files" in proc.stderr and "Traceback" not in proc.stderr


def test_console_messages_with_markup_like_data_do_not_crash(capsys: pytest.CaptureFixture[str]) -> None:
    """A path such as 'out[/x]' is an unbalanced rich closing tag: the message prints as plain text."""
    from rich.console import Console

    from securetrain.cli.console import _Console

    out = _Console(file=None, force_terminal=False, width=200)
    out.print("wrote runs/out[/x]/model.stenc")
    assert "runs/out[/x]/model.stenc" in capsys.readouterr().out
    with pytest.raises(Exception, match="closing tag"):  # what a plain rich console does with it
        Console(width=200).print("wrote runs/out[/x]/model.stenc")

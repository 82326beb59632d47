"""``SECURETRAIN_<X>_FILE`` (Compose / Kubernetes secrets) resolve to ``SECURETRAIN_<X>``."""

from __future__ import annotations

import pytest

from securetrain.secretenv import SecretFileError, resolve_secret_files, secret_env


def test_file_variable_resolves_without_trailing_newline(tmp_path) -> None:
    f = tmp_path / "deid_key"
    f.write_text("ab" * 32 + "\n")
    env = {"SECURETRAIN_DEID_KEY_FILE": str(f), "OTHER_FILE": "/nope"}
    assert resolve_secret_files(env) == ["SECURETRAIN_DEID_KEY"]
    assert env == {"SECURETRAIN_DEID_KEY": "ab" * 32, "OTHER_FILE": "/nope"}


def test_both_set_is_refused(tmp_path) -> None:
    f = tmp_path / "p"
    f.write_text("x")
    with pytest.raises(SecretFileError, match="both"):
        secret_env("SECURETRAIN_KEK", {"SECURETRAIN_KEK": "y", "SECURETRAIN_KEK_FILE": str(f)})


@pytest.mark.parametrize("content", [None, b"", b"\xff\xfe"])
def test_unusable_files_are_one_line_errors_without_content(tmp_path, content) -> None:
    f = tmp_path / "secret"
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(SecretFileError) as err:
        resolve_secret_files({"SECURETRAIN_KEYRING_PASSPHRASE_FILE": str(f)})
    assert "SECURETRAIN_KEYRING_PASSPHRASE_FILE" in str(err.value) and "\n" not in str(err.value)


def test_cli_reads_the_passphrase_from_a_file(tmp_path) -> None:
    import os
    import subprocess
    import sys

    pw = tmp_path / "pw"
    pw.write_text("file-passphrase-123\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SECURETRAIN_KEYRING")}
    env["SECURETRAIN_KEYRING_PASSPHRASE_FILE"] = str(pw)
    ring = tmp_path / "ring.json"
    proc = subprocess.run([sys.executable, "-c", "from securetrain.cli.main import main; main()", "keys", "init",
                           "--keyring", str(ring)], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from securetrain.crypto.keys import LocalKeyring

    assert LocalKeyring.load(ring, passphrase="file-passphrase-123").keys()
    assert "file-passphrase-123" not in proc.stdout + proc.stderr

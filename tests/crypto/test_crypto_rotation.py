"""Rotation refuses operator mistakes that would destroy the only copy of a KEK; removed keys go to escrow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.crypto import _container as S
from securetrain.crypto import cli as crypto_cli
from securetrain.crypto.errors import KeyringError
from securetrain.crypto.keys import LocalKeyring, validate_key_id
from securetrain.crypto.rotation import (
    KeyStillInUseError,
    RewrapFailedError,
    RotationRefusedError,
    escrow_list,
    escrow_path,
    purge_escrow,
    restore_from_escrow,
    rotate_keyring,
)

PASS = "rotation passphrase"


@pytest.fixture()
def setup(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    monkeypatch.setattr("securetrain.crypto.keys.SCRYPT_DEFAULT_LOG2_N", 10)
    kr = tmp_path / "ring.json"
    ring = LocalKeyring.create("k1")
    ring.save(kr)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    data = os.urandom(3000)
    S.encrypt_file(_write(tmp_path / "p.bin", data), ckpts / "a.stenc", ring, segment_size=1024)
    return tmp_path, kr, ckpts, data


def _write(path, data):  # type: ignore[no-untyped-def]
    path.write_bytes(data)
    return path


def _ids(kr) -> list[str]:  # type: ignore[no-untyped-def]
    return LocalKeyring.load(kr).key_ids()


def test_mistyped_rewrap_path_is_refused_and_changes_nothing(setup) -> None:
    tmp, kr, ckpts, _ = setup
    before = kr.read_bytes()
    with pytest.raises(RotationRefusedError, match="do not exist"):
        rotate_keyring(kr, rewrap=[tmp / "ckpst"], remove_old=True)
    assert kr.read_bytes() == before and _ids(kr) == ["k1"]


def test_remove_old_without_rewrap_is_refused(setup) -> None:
    _, kr, _, _ = setup
    before = kr.read_bytes()
    with pytest.raises(RotationRefusedError, match="without --rewrap"):
        rotate_keyring(kr, remove_old=True)
    assert kr.read_bytes() == before


def test_rewrap_directory_without_containers_is_refused(setup) -> None:
    tmp, kr, _, _ = setup
    empty = tmp / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no containers here")
    with pytest.raises(RotationRefusedError, match="no containers"):
        rotate_keyring(kr, rewrap=[empty], remove_old=True)
    assert _ids(kr) == ["k1"]


def test_key_still_wrapping_a_data_key_is_never_removed(setup) -> None:
    """A file whose re-wrap fails (here: truncated) keeps its old stanza: the old key must stay."""
    tmp, kr, ckpts, data = setup
    ring = LocalKeyring.load(kr)
    S.encrypt_file(_write(tmp / "q.bin", data), ckpts / "b.stenc", ring, segment_size=1024)
    blob = (ckpts / "b.stenc").read_bytes()
    (ckpts / "b.stenc").write_bytes(blob[:-5])
    with pytest.raises(RewrapFailedError, match="b.stenc"):
        rotate_keyring(kr, rewrap=[ckpts], new_key_id="k2", remove_old=True)
    assert _ids(kr) == ["k1", "k2"], "k1 still wraps b.stenc's data key: kept"
    assert not escrow_path(kr).exists()


def test_other_recipient_stanza_keeps_the_old_key(setup) -> None:
    """A stanza of an old key that rotation does not replace (second recipient) blocks its removal."""
    tmp, kr, ckpts, data = setup
    ring = LocalKeyring.load(kr)
    ring.rotate("k1b")
    ring.save(kr)
    # Wrapped under k1b (current) *and* k1 as an extra recipient: re-wrap replaces k1b only.
    S.encrypt_file(_write(tmp / "q.bin", data), ckpts / "c.stenc", ring, segment_size=1024, key_id="k1b",
                   recipients=[(ring, "k1")])
    with pytest.raises(KeyStillInUseError, match="k1"):
        rotate_keyring(kr, rewrap=[ckpts], new_key_id="k2", remove_old=True)
    assert set(_ids(kr)) == {"k1", "k1b", "k2"}


def test_remove_old_escrows_then_purge(setup) -> None:
    tmp, kr, ckpts, data = setup
    ring = LocalKeyring.load(kr)
    old_copy = (ckpts / "a.stenc").read_bytes()  # a backup still under k1
    audit = MemoryAuditRecorder()
    result = rotate_keyring(kr, rewrap=[ckpts], new_key_id="k2", remove_old=True, audit=audit)
    assert result.removed == ("k1",) and [p.name for p in result.rewrapped] == ["a.stenc"]
    assert _ids(kr) == ["k2"]
    assert (escrow_path(kr).stat().st_mode & 0o777) == 0o600
    assert PASS.encode() not in escrow_path(kr).read_bytes()
    escrowed = escrow_list(kr)
    assert [k.key_id for k in escrowed] == ["k1"] and escrowed[0] == ring.keys()[0]
    assert ring.keys()[0].material().hex() not in escrow_path(kr).read_text()
    actions = [e["action"] for e in audit.events]
    assert "key.escrow" in actions and "key.rotate" in actions
    rotate = next(e["details"] for e in audit.events if e["action"] == "key.rotate")
    assert rotate["new_key_id"] == "k2" and rotate["previous_key_ids"] == ["k1"] and rotate["removed_key_ids"] == ["k1"]
    assert result.new_key.key_id == "k2"
    # The escrow can open the old backup (it is a keyring file), and restore puts k1 back.
    assert S.decrypt_bytes(old_copy, LocalKeyring.load(escrow_path(kr))) == data
    restore_from_escrow(kr, "k1", audit=audit)
    assert set(_ids(kr)) == {"k1", "k2"} and LocalKeyring.load(kr).current_key_id() == "k2"
    assert not escrow_path(kr).exists()
    # Rotate again, then purge explicitly.
    rotate_keyring(kr, rewrap=[ckpts], new_key_id="k3", remove_old=True)
    assert {k.key_id for k in escrow_list(kr)} == {"k1", "k2"}
    with pytest.raises(KeyringError, match="--all"):
        purge_escrow(kr)
    with pytest.raises(KeyringError, match="not in the escrow"):
        purge_escrow(kr, key_ids=["nope"])
    assert purge_escrow(kr, key_ids=["k1"], audit=audit) == ["k1"]
    assert [k.key_id for k in escrow_list(kr)] == ["k2"]
    assert purge_escrow(kr, purge_all=True) == ["k2"]
    assert not escrow_path(kr).exists() and escrow_list(kr) == []
    assert S.decrypt_file(ckpts / "a.stenc", tmp / "out.bin", LocalKeyring.load(kr)).key_ids == ["k3"]


def test_key_id_validation_and_directory_keyring(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    with pytest.raises(KeyringError, match="invalid key id"):
        validate_key_id("k1\n")
    with pytest.raises(KeyringError, match="not a regular file"):
        LocalKeyring.load(tmp_path)


# -- through the CLI: exit code, one-line message, no traceback ------------------------------


@pytest.fixture()
def app() -> typer.Typer:
    root = typer.Typer()

    @root.callback()
    def _cb() -> None:
        pass

    crypto_cli.register(root)
    return root


def test_cli_refusals_are_typed(app: typer.Typer, setup) -> None:
    tmp, kr, ckpts, _ = setup
    runner = CliRunner()
    r = runner.invoke(app, ["keys", "rotate", "-k", str(kr), "--rewrap", str(tmp / "typo"), "--remove-old"])
    assert isinstance(r.exception, RotationRefusedError) and _ids(kr) == ["k1"]
    r = runner.invoke(app, ["keys", "rotate", "-k", str(kr), "--remove-old"])
    assert isinstance(r.exception, RotationRefusedError) and _ids(kr) == ["k1"]
    r = runner.invoke(app, ["keys", "rotate", "-k", str(kr), "--rewrap", str(ckpts), "--key-id", "k2",
                            "--remove-old"])
    assert r.exit_code == 0, r.output
    assert "escrow" in r.output and _ids(kr) == ["k2"]
    r = runner.invoke(app, ["keys", "escrow", "list", "-k", str(kr)])
    assert r.exit_code == 0 and "k1" in r.output
    r = runner.invoke(app, ["keys", "escrow", "purge", "-k", str(kr), "--key-id", "k1", "--yes"])
    assert r.exit_code == 0, r.output
    assert not escrow_path(kr).exists()


def test_console_entry_point_prints_no_traceback(setup) -> None:
    tmp, kr, _, _ = setup
    env = {**os.environ, "SECURETRAIN_KEYRING_PASSPHRASE": PASS}
    for args in (["keys", "rotate", "-k", str(kr), "--rewrap", str(tmp / "typo"), "--remove-old"],
                 ["keys", "rotate", "-k", str(kr), "--remove-old"],
                 ["keys", "list", "-k", str(tmp)]):
        proc = subprocess.run([sys.executable, "-c", "from securetrain.cli.main import main; main()", *args],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout and "error:" in proc.stderr
    assert _ids(kr) == ["k1"]

"""`securetrain checkpoint ...` / `securetrain keys ...` through typer's runner."""

from __future__ import annotations

import json
import os

import pytest
import typer
from typer.testing import CliRunner

from securetrain.crypto import _container as S
from securetrain.crypto import cli as crypto_cli
from securetrain.crypto.errors import HeaderAuthError, KeyNotFoundError, KeyringPermissionError, SegmentAuthError
from securetrain.crypto.keys import LocalKeyring

PASS = "cli passphrase 123"


@pytest.fixture()
def app() -> typer.Typer:
    root = typer.Typer()

    @root.callback()
    def _cb() -> None:  # force sub-command mode
        pass

    crypto_cli.register(root)
    return root


@pytest.fixture()
def env(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    monkeypatch.delenv("SECURETRAIN_KEK", raising=False)
    monkeypatch.setattr("securetrain.crypto.keys.SCRYPT_DEFAULT_LOG2_N", 10)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(app: typer.Typer, *args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, list(args), catch_exceptions=True)


def test_keys_and_checkpoint_workflow(app: typer.Typer, env) -> None:
    kr = env / "keyring.json"
    r = run(app, "keys", "init", "--keyring", str(kr), "--key-id", "k1")
    assert r.exit_code == 0, r.output
    assert (kr.stat().st_mode & 0o777) == 0o600
    material = LocalKeyring.load(kr).keys()[0].material()
    assert run(app, "keys", "init", "--keyring", str(kr)).exception is not None  # no silent overwrite

    plain = env / "weights.bin"
    data = os.urandom(3 * 65536 + 17)
    plain.write_bytes(data)
    r = run(app, "checkpoint", "encrypt", str(plain), "w.stenc", "-k", str(kr), "--segment-size", "65536")
    assert r.exit_code == 0, r.output
    r = run(app, "checkpoint", "inspect", "w.stenc", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["segment_size"] == 65536 and info["segments"] == 4 and info["keys"][0]["key_id"] == "k1"
    assert material.hex() not in r.output
    assert run(app, "checkpoint", "verify", "w.stenc", "-k", str(kr)).exit_code == 0

    before = (env / "w.stenc").read_bytes()
    r = run(app, "keys", "rotate", "-k", str(kr), "--key-id", "k2", "--rewrap", str(env), "--remove-old")
    assert r.exit_code == 0, r.output
    after = (env / "w.stenc").read_bytes()
    assert before[-1000:] == after[-1000:] and S.inspect_file(env / "w.stenc").key_ids == ["k2"]
    r = run(app, "keys", "list", "-k", str(kr))
    assert "k2" in r.output and "k1" not in r.output and material.hex() not in r.output

    r = run(app, "checkpoint", "decrypt", "w.stenc", "out.bin", "-k", str(kr))
    assert r.exit_code == 0, r.output
    assert (env / "out.bin").read_bytes() == data


def test_verify_and_decrypt_fail_closed(app: typer.Typer, env) -> None:
    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    ring = LocalKeyring.load(kr)
    blob = bytearray(S.encrypt_bytes(os.urandom(5000), ring, segment_size=1024))
    blob[-100] ^= 1
    (env / "bad.stenc").write_bytes(bytes(blob))
    r = run(app, "checkpoint", "verify", "bad.stenc", "-k", str(kr))
    assert isinstance(r.exception, SegmentAuthError)
    r = run(app, "checkpoint", "decrypt", "bad.stenc", "out.bin", "-k", str(kr))
    assert isinstance(r.exception, SegmentAuthError)
    assert not (env / "out.bin").exists(), "no partial plaintext on failure"
    assert not [p for p in env.iterdir() if p.name.endswith(".tmp")]
    blob[20] ^= 1
    (env / "bad.stenc").write_bytes(bytes(blob))
    assert isinstance(run(app, "checkpoint", "verify", "bad.stenc", "-k", str(kr)).exception, HeaderAuthError)


def test_cli_refuses_unsafe_keyring_and_unknown_key(app: typer.Typer, env) -> None:
    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    other = env / "other.json"
    assert run(app, "keys", "init", "-k", str(other)).exit_code == 0
    (env / "p").write_bytes(b"x" * 10)
    assert run(app, "checkpoint", "encrypt", "p", "c.stenc", "-k", str(kr)).exit_code == 0
    assert isinstance(run(app, "checkpoint", "verify", "c.stenc", "-k", str(other)).exception, KeyNotFoundError)
    os.chmod(kr, 0o644)
    assert isinstance(run(app, "keys", "list", "-k", str(kr)).exception, KeyringPermissionError)


def test_help_is_cheap() -> None:
    import subprocess
    import sys

    code = ("import sys, typer; from securetrain.crypto import cli; "
            "bad = [m for m in ('torch', 'cryptography', 'prefect', 'safetensors') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_signatures_and_os_errors_are_typed(app: typer.Typer, env, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from securetrain.crypto.errors import CryptoError, SignatureError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    ring = LocalKeyring.load(kr)
    writer = Ed25519PrivateKey.generate()
    pub = writer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    (env / "s.stenc").write_bytes(S.encrypt_bytes(b"signed payload", ring, signer=writer))
    (env / "u.stenc").write_bytes(S.encrypt_bytes(b"unsigned payload", ring))
    assert run(app, "checkpoint", "verify", "s.stenc", "-k", str(kr), "--signer-key", pub).exit_code == 0
    r = run(app, "checkpoint", "verify", "u.stenc", "-k", str(kr), "--signer-key", pub)
    assert isinstance(r.exception, SignatureError)
    r = run(app, "checkpoint", "decrypt", "u.stenc", "out.bin", "-k", str(kr), "--signer-key", pub)
    assert isinstance(r.exception, SignatureError) and not (env / "out.bin").exists()
    assert isinstance(run(app, "checkpoint", "verify", "s.stenc", "-k", str(kr), "--signer-key", "zz").exception,
                      SignatureError)
    info = json.loads(run(app, "checkpoint", "inspect", "s.stenc", "--json").output)
    assert info["signed"] is True and info["format_version"] == 2
    (env / "ro").mkdir()
    os.chmod(env / "ro", 0o500)
    try:
        r = run(app, "checkpoint", "decrypt", "s.stenc", str(env / "ro" / "x" / "out.bin"), "-k", str(kr))
        if os.geteuid() != 0:  # root may write anyway
            assert isinstance(r.exception, CryptoError), r.exception
    finally:
        os.chmod(env / "ro", 0o700)
    r = run(app, "checkpoint", "decrypt", "s.stenc", str(env / "s.stenc" / "out.bin"), "-k", str(kr))
    assert isinstance(r.exception, CryptoError), r.exception  # parent is a file: ENOTDIR, typed


@pytest.mark.parametrize("command", ["encrypt", "decrypt"])
def test_output_that_is_a_directory_is_refused_up_front_naming_it(app: typer.Typer, env, command: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """OUT an existing directory: one typed error naming OUT (not an internal temp name), before any work,
    nothing left in or next to it. Both the O_TMPFILE and the named-temp writer."""
    from securetrain.crypto import private_file
    from securetrain.crypto.errors import CryptoError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    (env / "plain.bin").write_bytes(os.urandom(1000))
    assert run(app, "checkpoint", "encrypt", "plain.bin", "c.stenc", "-k", str(kr)).exit_code == 0
    source = "plain.bin" if command == "encrypt" else "c.stenc"
    streamed: list[str] = []
    monkeypatch.setattr(crypto_cli, "_run_stream", lambda *a, **k: streamed.append("x"))
    for use_tmpfile in (True, False):
        monkeypatch.setattr(private_file, "USE_O_TMPFILE", use_tmpfile)
        (env / "outdir").mkdir()
        before = sorted(p.name for p in env.iterdir())
        r = run(app, "checkpoint", command, source, "outdir", "-k", str(kr))
        assert isinstance(r.exception, CryptoError), (use_tmpfile, r.exception)
        assert "is a directory" in str(r.exception).lower() and "outdir" in str(r.exception), r.exception
        assert ".tmp" not in str(r.exception), r.exception
        assert not streamed, "refused only after the whole input was processed"
        assert sorted(p.name for p in env.iterdir()) == before and not any((env / "outdir").iterdir())
        (env / "outdir").rmdir()


def test_verify_several_files_checks_every_one_and_names_the_bad_ones(app: typer.Typer, env) -> None:
    """`checkpoint verify FILE…`: a bad file is named (the error used to say only "payload is N bytes
    shorter…", with no file), and the files after it are still verified; exit status 2, typed."""
    from securetrain.crypto.errors import TruncatedError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    ring = LocalKeyring.load(kr)
    good = S.encrypt_bytes(os.urandom(3000), ring, segment_size=1024)
    (env / "a.stenc").write_bytes(good)
    (env / "cut.stenc").write_bytes(good[:-500])
    (env / "flip.stenc").write_bytes(good[:-10] + bytes([good[-10] ^ 1]) + good[-9:])
    (env / "z.stenc").write_bytes(good)
    r = run(app, "checkpoint", "verify", "a.stenc", "cut.stenc", "z.stenc", "flip.stenc", "-k", str(kr))
    assert isinstance(r.exception, TruncatedError), r.exception  # the first failure's type
    assert "cut.stenc" in str(r.exception) and "2 of 4" in str(r.exception), r.exception
    out = " ".join(r.output.split())
    assert "OK a.stenc" in out and "OK z.stenc" in out, out  # verified after the bad one
    assert "FAILED cut.stenc" in out and "FAILED flip.stenc" in out, out
    r = run(app, "checkpoint", "verify", "cut.stenc", "-k", str(kr))
    assert isinstance(r.exception, TruncatedError) and str(r.exception).startswith("cut.stenc: "), r.exception


def _feed_fifo(path, data: bytes):  # type: ignore[no-untyped-def]
    """A FIFO at ``path`` and a thread writing ``data`` into it (it blocks until a reader opens it)."""
    import threading

    os.mkfifo(path)

    def write() -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BrokenPipeError:  # the reader went away (a refused encrypt): nothing to deliver
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_encrypt_from_a_pipe_is_refused_clearly_without_length(app: typer.Typer, env) -> None:
    """Found by review: `cat x | securetrain checkpoint encrypt /dev/stdin ...` (or a FIFO) said only
    "source has more than the declared 0 bytes". The container declares the plaintext length in its
    header before the first segment, so a pipe needs --length; without it: one clear error, up front,
    before the pipe is read or the output created."""
    from securetrain.crypto.errors import CryptoError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    writer = _feed_fifo(env / "pipe", b"x" * 10)
    r = run(app, "checkpoint", "encrypt", "pipe", "c.stenc", "-k", str(kr))
    os.close(os.open(env / "pipe", os.O_RDONLY | os.O_NONBLOCK))  # lets the writer's open return
    writer.join(5)
    assert isinstance(r.exception, CryptoError), r.exception
    message = str(r.exception)
    assert "pipe" in message and "--length" in message and "declared 0 bytes" not in message, message
    assert not (env / "c.stenc").exists()


def test_encrypt_streams_from_a_pipe_with_length(app: typer.Typer, env) -> None:
    from securetrain.crypto.errors import LimitExceededError, TruncatedError

    kr = env / "keyring.json"
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    data = os.urandom(3 * 1024 + 5)
    _feed_fifo(env / "pipe", data).join(0)
    r = run(app, "checkpoint", "encrypt", "pipe", "c.stenc", "-k", str(kr), "--length", str(len(data)),
            "--segment-size", "1024")
    assert r.exit_code == 0, r.output
    assert run(app, "checkpoint", "decrypt", "c.stenc", "out.bin", "-k", str(kr)).exit_code == 0
    assert (env / "out.bin").read_bytes() == data
    _feed_fifo(env / "cpipe", (env / "c.stenc").read_bytes())  # decrypt reads a pipe as it is
    r = run(app, "checkpoint", "decrypt", "cpipe", "out2.bin", "-k", str(kr))
    assert r.exit_code == 0, r.output
    assert (env / "out2.bin").read_bytes() == data
    # A pipe that delivers more or less than declared: typed, and no container is written.
    for declared, error in ((len(data) - 1, LimitExceededError), (len(data) + 1, TruncatedError)):
        os.unlink(env / "pipe")
        _feed_fifo(env / "pipe", data)
        r = run(app, "checkpoint", "encrypt", "pipe", "d.stenc", "-k", str(kr), "--length", str(declared))
        assert isinstance(r.exception, error), r.exception
        assert not (env / "d.stenc").exists()
    # A regular file with a --length that is not its size: refused before anything is written.
    (env / "plain.bin").write_bytes(data)
    r = run(app, "checkpoint", "encrypt", "plain.bin", "d.stenc", "-k", str(kr), "--length", "7")
    assert "--length" in str(r.exception) and not (env / "d.stenc").exists(), r.exception


def test_failed_keys_init_leaves_no_lock_file(app: typer.Typer, env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a failed `keys init` left an empty `<keyring>.lock` behind. The lock file a run
    created is removed when it is done (failed or not)."""
    from securetrain.crypto.errors import KeyringError

    kr = env / "keyring.json"
    lock = env / "keyring.json.lock"
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", "short")  # refused inside the lock (save)
    r = run(app, "keys", "init", "-k", str(kr))
    assert isinstance(r.exception, KeyringError), r.exception
    assert not kr.exists() and not lock.exists()
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    assert run(app, "keys", "init", "-k", str(kr)).exit_code == 0
    assert not lock.exists()
    assert isinstance(run(app, "keys", "init", "-k", str(kr)).exception, KeyringError)  # exists, no --force
    assert not lock.exists()


def test_a_lock_file_left_behind_does_not_block_the_next_run(app: typer.Typer, env) -> None:
    """A lock file from elsewhere (an older version, a crash) is harmless: the next run takes the lock
    and leaves that file alone (it removes only a lock file it created)."""
    kr = env / "keyring.json"
    lock = env / "keyring.json.lock"
    lock.write_bytes(b"")
    os.chmod(lock, 0o400)  # even one this user cannot write
    r = run(app, "keys", "init", "-k", str(kr))
    assert r.exit_code == 0, r.output
    assert lock.exists() and kr.exists()
    assert run(app, "keys", "rotate", "-k", str(kr)).exit_code == 0
    assert lock.exists()

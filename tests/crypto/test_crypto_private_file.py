"""A killed decrypt leaves no plaintext: O_TMPFILE + linkat, else a 0600 temp removed on signals.

The kill cases run in subprocesses that slow decryption down (a sleep per segment) and announce
when plaintext is being written; the parent then sends the signal and inspects the directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from securetrain.crypto import _container as S
from securetrain.crypto import private_file as P
from securetrain.crypto.keys import EnvKeyProvider

KEK = "11" * 32
ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import signal, sys, time
    # A writer in a normal session: SIGHUP at its default even when the tests run under nohup
    # (which ignores it, and the writer rightly keeps an ignored signal ignored).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    from securetrain.crypto import private_file
    from securetrain.crypto import _container as S
    from securetrain.crypto.keys import EnvKeyProvider
    mode, src, dst = sys.argv[1:4]
    if mode == "named":
        private_file.USE_O_TMPFILE = False
    orig = S.DecryptingReader._next_segment
    count = [0]
    def slow(self, into=None):
        out = orig(self, into)
        count[0] += 1
        if count[0] == 3:
            print("WRITING", flush=True)
        time.sleep(0.05)
        return out
    S.DecryptingReader._next_segment = slow
    if sys.argv[4] == "cli":
        from securetrain.cli.main import main
        sys.argv = ["securetrain", "checkpoint", "decrypt", src, dst]
        main()
    else:
        S.decrypt_file(src, dst, EnvKeyProvider())
""")


@pytest.fixture()
def container(tmp_path: Path) -> Path:
    provider = EnvKeyProvider({"SECURETRAIN_KEK": KEK, "SECURETRAIN_KEK_ID": "kill-test"})
    blob = S.encrypt_bytes(os.urandom(200 * 4096), provider, segment_size=4096)
    path = tmp_path / "ckpt.stenc"
    path.write_bytes(blob)
    return path


def _run_and_kill(tmp_path: Path, container: Path, mode: str, sig: int, how: str = "lib") -> list[str]:
    """Start a slow decrypt, wait until plaintext is being written, list the dir, send ``sig``."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "SECURETRAIN_KEK": KEK, "SECURETRAIN_KEK_ID": "kill-test",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("SECURETRAIN_KEYRING", None)
    proc = subprocess.Popen([sys.executable, str(script), mode, str(container), str(tmp_path / "out.bin"), how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "WRITING", proc.stderr.read()  # type: ignore[union-attr]
        during = sorted(p.name for p in tmp_path.iterdir())
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    return during


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_decrypt_leaves_nothing_with_o_tmpfile(tmp_path: Path, container: Path, sig: int) -> None:
    if not P.USE_O_TMPFILE or P._open_anonymous(tmp_path, 0o600) is None:
        pytest.skip("this filesystem has no O_TMPFILE + linkat")
    during = _run_and_kill(tmp_path, container, "tmpfile", sig)
    assert during == ["child.py", "ckpt.stenc"], "plaintext in progress has no name at all"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "ckpt.stenc"]


def test_killed_cli_decrypt_leaves_nothing(tmp_path: Path, container: Path) -> None:
    if P._open_anonymous(tmp_path, 0o600) is None:
        pytest.skip("this filesystem has no O_TMPFILE + linkat")
    _run_and_kill(tmp_path, container, "tmpfile", signal.SIGKILL, how="cli")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "ckpt.stenc"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_named_temp_is_removed_on_signals(tmp_path: Path, container: Path, sig: int) -> None:
    during = _run_and_kill(tmp_path, container, "named", sig)
    temps = [n for n in during if n.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith(".out.bin."), during  # the fallback really wrote a temp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "ckpt.stenc"]


def test_named_temp_of_sigkilled_writer_is_swept(tmp_path: Path, container: Path) -> None:
    during = _run_and_kill(tmp_path, container, "named", signal.SIGKILL)
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and [p.name for p in left] == [n for n in during if n.endswith(".tmp")]
    assert (left[0].stat().st_mode & 0o777) == 0o600
    assert P.sweep_stale_temps(tmp_path) == left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "ckpt.stenc"]


def test_sweep_keeps_temps_of_live_writers(tmp_path: Path) -> None:
    live = P.temp_name(tmp_path / "x.stenc")  # our own pid: alive
    live.write_bytes(b"in progress")
    dead = tmp_path / f".x.stenc.{P.host_tag()}-999999999.{'0' * 16}.tmp"
    dead.write_bytes(b"left by a dead writer")
    other = tmp_path / "notes.tmp"  # not hidden: never ours
    other.write_bytes(b"x")
    assert P.sweep_stale_temps(tmp_path) == [dead]
    assert live.exists() and other.exists()
    old = tmp_path / ".y.stenc.abcd1234.tmp"  # a tempfile.mkstemp name: swept only when old
    old.write_bytes(b"x")
    assert P.sweep_stale_temps(tmp_path) == []
    os.utime(old, (1, 1))
    assert P.sweep_stale_temps(tmp_path) == [old]


def test_private_writer_replaces_atomically_and_cleans_up_on_error(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "t.bin"
    for use_tmpfile in (True, False):
        monkeypatch.setattr(P, "USE_O_TMPFILE", use_tmpfile)
        target.write_bytes(b"old")
        with pytest.raises(RuntimeError):
            with P.private_writer(target) as f:
                f.write(b"partial")
                raise RuntimeError("boom")
        assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]
        with P.private_writer(target) as f:
            f.write(b"new")
        assert target.read_bytes() == b"new" and (target.stat().st_mode & 0o777) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]


def test_cli_decrypt_hashes_while_streaming(tmp_path: Path, monkeypatch) -> None:
    """The audit digest no longer needs the whole container in memory (it read it all before)."""
    import typer
    from typer.testing import CliRunner

    from securetrain.crypto import cli as crypto_cli

    monkeypatch.setenv("SECURETRAIN_KEK", KEK)
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    provider = EnvKeyProvider()
    src = tmp_path / "big.stenc"
    plain = tmp_path / "plain.bin"
    plain.write_bytes(os.urandom(24 << 20))
    S.encrypt_file(plain, src, provider)
    root = typer.Typer()

    @root.callback()
    def _cb() -> None:
        pass

    crypto_cli.register(root)
    db = tmp_path / "audit.sqlite"
    warm = tmp_path / "warm.stenc"  # imports (rich, the audit store) happen outside the measurement
    small = tmp_path / "small.bin"
    small.write_bytes(b"w" * 4096)
    S.encrypt_file(small, warm, provider)
    r = CliRunner().invoke(root, ["checkpoint", "decrypt", str(warm), str(tmp_path / "w.bin"), "--audit-db", str(db)])
    tracemalloc.start()
    try:
        r = CliRunner().invoke(root, ["checkpoint", "decrypt", str(src), str(tmp_path / "out.bin"),
                                      "--audit-db", str(db)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out.bin").read_bytes() == plain.read_bytes()
    assert peak < 8 << 20, f"peak {peak >> 20} MiB for a 24 MiB container"
    import hashlib

    from securetrain.audit.log import AuditLog

    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    with AuditLog(str(db)) as log:
        events = [e for e in log.entries() if e.action == "checkpoint.decrypt" and e.resource == src.name]
    assert events and events[-1].details["ciphertext_sha256"] == digest


def test_background_hasher_matches_and_cancels(tmp_path: Path) -> None:
    import hashlib
    import threading

    data = os.urandom(9 << 20)
    with P.private_writer(tmp_path / "h.bin") as f:
        hasher = P.BackgroundFileHasher(f.fileno())
        for off in range(0, len(data), 1 << 20):
            f.write(data[off:off + (1 << 20)])
            f.flush()
            hasher.advance(len(data[off:off + (1 << 20)]))
        hasher.close()
    assert hasher.hexdigest() == hashlib.sha256(data).hexdigest() and hasher.count == len(data)
    with open(tmp_path / "h.bin", "rb") as f:
        other = P.BackgroundFileHasher(f.fileno())
        other.advance(len(data))
        other.cancel()
    assert not [t for t in threading.enumerate() if t.name == "securetrain-file-hash"]


@pytest.mark.parametrize("kind", ["symlink", "dangling", "fifo", "dir"])
def test_private_writer_refuses_a_destination_that_is_not_a_regular_file(tmp_path: Path, monkeypatch, kind: str) -> None:
    """`checkpoint decrypt IN /dev/stdout` used to *replace* the /dev/stdout symlink with a regular file
    holding the plaintext; symlinks, FIFOs, devices and directories are refused before anything is
    written, and left exactly as they were."""
    real = tmp_path / "real.bin"
    real.write_bytes(b"keep")
    dest = tmp_path / "dest"
    if kind == "symlink":
        dest.symlink_to(real)
    elif kind == "dangling":
        dest.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(dest)
    else:
        dest.mkdir()
    before = sorted((p.name, p.lstat().st_mode) for p in tmp_path.iterdir())
    for use_tmpfile in (True, False):
        monkeypatch.setattr(P, "USE_O_TMPFILE", use_tmpfile)
        entered = []
        with pytest.raises(OSError) as info:
            with P.private_writer(dest) as f:
                entered.append(1)
                f.write(b"plaintext")
        assert not entered and info.value.filename == str(dest), info.value
        assert sorted((p.name, p.lstat().st_mode) for p in tmp_path.iterdir()) == before
        assert real.read_bytes() == b"keep"


def test_cli_decrypt_to_a_symlink_is_refused_and_the_link_kept(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from securetrain.cli.main import app
    from securetrain.crypto.errors import CryptoError

    monkeypatch.setenv("SECURETRAIN_KEK", KEK)
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    src = tmp_path / "c.stenc"
    src.write_bytes(S.encrypt_bytes(b"secret weights", EnvKeyProvider()))
    sink = tmp_path / "sink"
    sink.write_bytes(b"")
    link = tmp_path / "stdout-like"
    link.symlink_to(sink)
    r = CliRunner().invoke(app, ["checkpoint", "decrypt", str(src), str(link)])
    assert isinstance(r.exception, CryptoError) and "not a regular file" in str(r.exception), r.exception
    assert link.is_symlink() and sink.read_bytes() == b""

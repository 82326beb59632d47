"""Group commit durability: kill -9 mid-batch loses nothing acknowledged; asynchronous mode flushes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from securetrain.audit.log import AuditLog

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent("""
    import sys, threading
    from securetrain.audit.log import AuditLog
    url, key, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    log = AuditLog(url, signing_key=key, checkpoint_every=50, group_commit_window_s=0.001)
    out = threading.Lock()
    def work(t):
        i = 0
        while True:
            log.record("kill.test", f"{tag}t{t}:{i}", details={"i": i})
            with out:
                sys.stdout.write(f"ack {tag}t{t}:{i}\\n"); sys.stdout.flush()
            i += 1
    for t in range(6):
        threading.Thread(target=work, args=(t,), daemon=True).start()
    threading.Event().wait()
""")


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "SECURETRAIN_DATA_DIR": str(tmp_path)}


def _key(tmp_path: Path) -> str:
    from securetrain.audit.keys import load_or_create_signing_key

    path = tmp_path / "audit-key.pem"
    load_or_create_signing_key(path)
    return str(path)


@pytest.mark.slow
def test_kill_9_mid_batch_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db, key = tmp_path / "audit.db", _key(tmp_path)
    AuditLog(db, signing_key=key).close()
    acked: set[str] = set()
    for round_ in range(2):  # the second writer continues the log the first one left behind
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), key, f"r{round_}"], stdout=subprocess.PIPE,
                                env=_env(tmp_path), text=True)
        assert proc.stdout is not None
        target = len(acked) + 300
        while len(acked) < target:
            line = proc.stdout.readline()
            assert line, "writer died"
            acked.add(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)  # six threads are mid-record: some inside a batch
        rest = proc.stdout.read()
        proc.wait()
        acked.update(line.split()[1] for line in rest.splitlines() if line.startswith("ack "))
        log = AuditLog(db, signing_key=key, create=False)
        stored = [e.resource for e in log.entries()]
        assert acked <= set(stored), f"{len(acked - set(stored))} acknowledged entries lost"
        assert len(stored) == len(set(stored))
        report = log.verify()
        assert report.ok, report.error
        log.close()


SIGTERM_WRITER = textwrap.dedent("""
    import sys, time
    from securetrain.audit.log import AuditLog
    log = AuditLog(sys.argv[1], checkpoint_every=None, durable=False, group_commit_window_s=1.0)
    for i in range(200):
        log.record("async.test", f"r{i}")
    print("queued", flush=True)
    time.sleep(30)
""")


@pytest.mark.slow
def test_async_mode_flushes_on_sigterm(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_WRITER, str(db)], stdout=subprocess.PIPE,
                            env=_env(tmp_path), text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "queued"
    proc.send_signal(signal.SIGTERM)  # the flusher is still inside its 1 s window
    assert proc.wait(30) == -signal.SIGTERM  # the default action still ends the process
    log = AuditLog(db, create=False)
    assert log.size() == 200 and log.verify().ok
    log.close()


def test_async_mode_flushes_before_checkpoint_and_on_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    key = _key(tmp_path)
    log = AuditLog(tmp_path / "audit.db", signing_key=key, checkpoint_every=None, durable=False,
                   group_commit_window_s=0.5)
    t0 = time.perf_counter()
    for i in range(50):
        assert log.record("async.test", f"r{i}") is None
    assert time.perf_counter() - t0 < 0.5  # returned before anything was committed
    cp = log.checkpoint()
    assert cp.tree_size == 50  # the checkpoint covers everything queued before it
    for i in range(50, 70):
        log.record("async.test", f"r{i}")
    log.close()
    reopened = AuditLog(tmp_path / "audit.db", signing_key=key, create=False)
    assert [e.resource for e in reopened.entries()] == [f"r{i}" for i in range(70)]
    assert reopened.verify().ok
    reopened.close()


def test_async_failure_is_raised_on_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.audit.errors import AuditError

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None, durable=False)

    def broken(batch):  # noqa: ANN001, ANN202
        for r in batch:
            r.error = AuditError("database gone")
        return False

    log._commit_batch = broken  # type: ignore[method-assign]
    log.record("async.test", "r0")
    with pytest.raises(AuditError, match="database gone"):
        log.flush()
    with pytest.raises(AuditError, match="database gone"):  # fail closed: no silent loss afterwards
        log.record("async.test", "r1")
    with pytest.raises(AuditError, match="database gone"):  # close reports it too, and stays closed
        log.close()


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_sqlite_writer_turn_is_only_a_scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers take turns through ``<db>.lock`` before BEGIN IMMEDIATE; a turn held elsewhere
    forever (a stuck or foreign process) delays an append by at most busy_timeout_s, after which
    SQLite's own lock decides, and the chain stays dense."""
    import fcntl

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None, busy_timeout_s=0.3)
    log.record("turn.test", "r0")
    assert (tmp_path / "audit.db.lock").is_file()
    fd = os.open(tmp_path / "audit.db.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file description: a rival writer
        t0 = time.monotonic()
        entry = log.record("turn.test", "r1")
        assert entry is not None and entry.seq == 1
        assert 0.25 <= time.monotonic() - t0 < 5
    finally:
        os.close(fd)
    assert log.record("turn.test", "r2").seq == 2  # type: ignore[union-attr]
    assert log.verify().ok
    log.close()

"""The SQLite writers' turn is handed over fairly (issue 10).

An asynchronous log appending in a tight loop keeps its flusher's queue from ever emptying: it
released the turn after each batch and took it again within microseconds, so a second log object
on the same database in the same process (which does not use the first one's committer, see
``_SERVING_HERE``), polling for the turn, almost never found it free and failed with
``AuditLockTimeoutError`` after its busy timeout; a fork waited for it in the at-fork hook.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from securetrain.audit import log as audit_log
from securetrain.audit.log import AuditLog

BUSY_S = 3.0  # the second log's busy timeout; starved, a record failed after 2 x this
RUN_S = 1.5  # how long the second log appends while the first one spins
#: How many entries the flusher may commit while another writer waits: the transaction it is in
#: and, had it ended before that writer queued, the next one (the third: slack). Counted in
#: entries, not seconds: how long a transaction takes depends on the machine's load.
BOUND = 3 * 500  # securetrain.audit.log._ASYNC_BATCH


@contextmanager
def _spinning(log: AuditLog, queued: int = 10_000) -> Iterator[list[BaseException]]:
    """A thread calling ``log.record()`` in a tight loop (asynchronous log) until the block ends.

    It pauses while more than ``queued`` entries wait, only so the final flush stays short: the
    flusher still finds work waiting whenever it ends a transaction (unbounded, a transaction
    took everything queued: up to ``queued`` entries).
    """
    stop = threading.Event()
    errors: list[BaseException] = []

    def spin() -> None:
        n = 0
        try:
            while not stop.is_set():
                log.record("test.spin", f"r{n}", details={"n": n})
                n += 1
                while len(log._gc_pending) > queued and not stop.is_set():
                    time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=spin, name="spinner", daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the flusher is busy from here on
        yield errors
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def _durable_records(log: AuditLog, seconds: float) -> tuple[list[tuple[int, float]], list[BaseException]]:
    """Durable ``record()`` calls for ``seconds`` (stopping at the first error): for each, how many
    entries were committed while it waited, and how long it took; the errors."""
    waits: list[tuple[int, float]] = []
    errors: list[BaseException] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = log.size()
        start = time.monotonic()
        try:
            entry = log.record("test.durable", f"d{len(waits)}")
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            waits.append((-1, time.monotonic() - start))
            break
        assert entry is not None
        waits.append((entry.seq - before, time.monotonic() - start))
    return waits, errors


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[AuditLog, AuditLog]]:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    db = tmp_path / "audit.db"
    fast = AuditLog(db, checkpoint_every=None, durable=False)
    slow = AuditLog(db, checkpoint_every=None, busy_timeout_s=BUSY_S)
    try:
        yield fast, slow
    finally:
        fast.close()
        slow.close()


def test_async_tight_loop_starves_neither_a_second_log_nor_a_fork(logs: tuple[AuditLog, AuditLog]) -> None:
    """While the asynchronous log spins, the durable one appends from a thread and the main thread
    forks three times. The at-fork hook takes every log's lock, so a fork waited as long as a
    writer starved of the turn; each forked child appends through both logs (its own turn queue)."""
    fast, slow = logs
    fork_waits: list[tuple[int, float]] = []
    statuses: list[int] = []
    result: dict[str, tuple[list[tuple[int, float]], list[BaseException]]] = {}
    with _spinning(fast) as spin_errors:
        writer = threading.Thread(target=lambda: result.update(r=_durable_records(slow, RUN_S)), name="durable")
        writer.start()
        try:
            for i in range(3):
                time.sleep(RUN_S / 4)
                before, start = fast.size(), time.monotonic()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child
                    code = 1
                    try:
                        slow.record("test.child", str(i))
                        fast.record("test.child_async", str(i))
                        fast.flush()
                        code = 0
                    finally:
                        os._exit(code)
                fork_waits.append((fast.size() - before, time.monotonic() - start))
                statuses.append(os.waitpid(pid, 0)[1])
        finally:
            writer.join(60)
    assert not spin_errors, spin_errors
    waits, errors = result["r"]
    assert not errors, f"after {len(waits)} records, {waits[-1][1]:.2f} s: {errors[0]!r}"
    # Before: a record waited for one of the flusher's unbounded transactions (all it had queued),
    # often for the turn the flusher took again at once after it, up to 2 x BUSY_S, and failed.
    assert max(n for n, _ in waits) <= BOUND, f"entries committed while a record waited: {waits}"
    assert max(t for _, t in waits) < BUSY_S
    assert len(waits) >= 3
    assert max(n for n, _ in fork_waits) <= BOUND, f"entries committed while a fork waited: {fork_waits}"
    assert statuses == [0, 0, 0]  # the children's appends did not time out either
    fast.flush()
    # Both log objects are one database: one verification covers it (dense seq, chain intact).
    report = slow.verify()
    assert report.ok, report.error
    assert report.entries == fast.size() >= len(waits) + 6


def test_a_forked_writer_is_not_starved_by_a_spinning_parent(
        logs: tuple[AuditLog, AuditLog], monkeypatch: pytest.MonkeyPatch) -> None:
    """Between processes the writers' turn was a bare ``flock`` polled with sleeps: a forked child
    committing its own durable appends (as DataLoader workers do) against a parent whose
    asynchronous log never runs out of work found it free only by chance, and waited for up to 20
    of the parent's transactions. A writer that has waited marks itself, and the parent then lets
    it in first: the child waits for the transaction in progress and at most the next. The child
    marks itself at once here (the default waits 25 ms first, a tuning for throughput under
    ordinary contention whose cost in transactions depends on the machine's speed)."""
    monkeypatch.setattr(audit_log, "_TURN_ESCALATE_S", 0.0)  # inherited by the forked child
    fast, slow = logs
    with _spinning(fast) as spin_errors:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(read_fd)
                waits, errors = _durable_records(slow, RUN_S)
                os.write(write_fd, repr((waits, [repr(e) for e in errors])).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as reader:
            raw = reader.read()
        status = os.waitpid(pid, 0)[1]
    assert status == 0 and not spin_errors, (status, spin_errors)
    waits, errors = eval(raw.decode())  # noqa: S307 - our own child's repr of ints, floats and strings
    assert not errors, errors
    assert len(waits) >= 5
    assert max(n for n, _ in waits) <= BOUND, f"entries committed while the child's record waited: {waits}"
    fast.flush()
    assert slow.verify().ok


def test_writers_still_take_turns_without_the_wait_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``<db>.lock-wait`` that cannot be opened (here a directory) only costs the courtesy: the
    turn file still orders writers, and appends from two processes land densely."""
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    db = tmp_path / "audit.db"
    (tmp_path / "audit.db.lock-wait").mkdir()
    log = AuditLog(db, checkpoint_every=None, shared_commit=False)
    log.record("test.a", "0")
    assert log._wait_fd == -1
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            for i in range(50):
                log.record("test.child", str(i))
            code = 0
        finally:
            os._exit(code)
    for i in range(50):
        log.record("test.parent", str(i))
    assert os.waitpid(pid, 0)[1] == 0
    assert log.size() == 101
    assert log.verify().ok
    log.close()

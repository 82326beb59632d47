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

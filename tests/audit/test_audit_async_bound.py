"""Asynchronous mode keeps a bounded queue: record() waits while max_queued events wait for the
background commit (a writer faster than the database cannot grow memory without bound), and a
failed commit wakes the waiting writers with its error instead of leaving them blocked."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from securetrain.audit.errors import AuditConfigError, AuditError
from securetrain.audit.log import AuditLog


def _gate_commits(monkeypatch: pytest.MonkeyPatch, gate: threading.Event, fail: bool = False) -> None:
    real = AuditLog._commit_batch

    def held(self: AuditLog, batch: list, prepare: object = None) -> bool:
        gate.wait(30)
        if fail:
            raise AuditError("database unavailable (test)")
        return real(self, batch, prepare)

    monkeypatch.setattr(AuditLog, "_commit_batch", held)


def test_record_waits_while_the_queue_is_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    _gate_commits(monkeypatch, gate)
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None, durable=False, max_queued=40)
    done: list[int] = []
    peak = [0]

    def writer() -> None:
        for i in range(100):
            log.record("bound.test", f"r:{i}")
            peak[0] = max(peak[0], log._gc_queued_events)
            done.append(i)

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(1.0)
    # The flusher took what was queued as one batch (its commit held here), the writer queued
    # max_queued more, then waited: in memory at most the batch in flight plus max_queued.
    assert 40 <= len(done) <= 80 and t.is_alive()
    assert peak[0] <= 40
    gate.set()
    t.join(30)
    assert not t.is_alive() and len(done) == 100
    log.flush()
    assert log.size() == 100 and log.verify().ok
    log.close()


def test_a_failed_commit_wakes_writers_waiting_for_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    _gate_commits(monkeypatch, gate, fail=True)
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None, durable=False, max_queued=5)
    raised: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(50):
                log.record("bound.test", f"r:{i}")
        except AuditError as exc:
            raised.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for room
    gate.set()
    t.join(10)
    assert not t.is_alive()
    assert raised and "unavailable" in str(raised[0])
    with pytest.raises(AuditError):
        log.record("bound.test", "after")  # fail closed
    with pytest.raises(AuditError):
        log.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_queued_must_be_a_positive_count(tmp_path: Path, bad: object) -> None:
    with pytest.raises(AuditConfigError, match="max_queued"):
        AuditLog(tmp_path / "audit.db", durable=False, max_queued=bad)  # type: ignore[arg-type]

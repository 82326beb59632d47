"""A periodic checkpoint that fails after its batch committed is reported as exactly that.

``record()`` commits, then (every ``checkpoint_every`` entries) signs a checkpoint. Before, when the
signing failed (tampering detected, signer or anchor down) ``record()`` raised the checkpoint's
error although its entry was committed, so a caller that retried recorded it twice; and a process
served by another's committer got that error *instead of* its entries. Now the caller gets
:class:`AuditCheckpointError` carrying its committed entries, with the cause attached.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from securetrain.audit import committer
from securetrain.audit.errors import AuditCheckpointError, AuditError, AuditSigningError
from securetrain.audit.keys import create_signing_key
from securetrain.audit.log import AuditLog


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    key = tmp_path / "audit-key.pem"
    create_signing_key(key)
    monkeypatch.setenv("SECURETRAIN_AUDIT_KEY", str(key))
    return f"sqlite:///{tmp_path / 'audit.db'}"


def _signer_down(*_a: Any, **_k: Any) -> Any:
    raise AuditSigningError("the checkpoint signer is unreachable", hint="check Vault")


def test_a_failed_periodic_checkpoint_returns_the_committed_entries_with_the_cause(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(url, checkpoint_every=3, shared_commit=False)
    log.record("a.b", "r0")
    log.record("a.b", "r1")
    monkeypatch.setattr(log, "checkpoint", _signer_down)
    with pytest.raises(AuditCheckpointError, match="do not append them again") as info:
        log.record("a.b", "r2")
    assert [e.resource for e in info.value.entries] == ["r2"] and info.value.entries[0].seq == 2
    assert isinstance(info.value.__cause__, AuditSigningError)
    assert info.value.hint == "check Vault"
    assert isinstance(info.value, AuditError)  # callers catching AuditError still catch it
    monkeypatch.undo()
    log.record("a.b", "r3")  # the log carries on; nothing was recorded twice
    assert [e.resource for e in log.entries()] == ["r0", "r1", "r2", "r3"]
    assert log.verify().ok
    log.close()


def test_append_many_gets_all_its_entries_back(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(url, checkpoint_every=2, shared_commit=False)
    monkeypatch.setattr(log, "checkpoint", _signer_down)
    with pytest.raises(AuditCheckpointError) as info:
        log.append_many([("a.b", f"r{i}", "success", None) for i in range(3)])
    assert [e.seq for e in info.value.entries] == [0, 1, 2]
    assert log.size() == 3
    log.close()


def _served_child(url: str, out: Any) -> None:
    log = AuditLog(url, checkpoint_every=None)  # the committer's own setting decides its checkpoints
    try:
        log.record("child.event", "served")
        out.put(("returned", None, None))
    except AuditCheckpointError as exc:
        out.put(("checkpoint", [e.seq for e in exc.entries], type(exc.__cause__).__name__))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("other", type(exc).__name__, str(exc)))
    finally:
        log.close()


@pytest.mark.skipif(not committer.supported(), reason="abstract Unix sockets are Linux-only")
def test_a_served_process_gets_its_entries_and_the_committers_checkpoint_error(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(url, checkpoint_every=2)
    log.record("parent.event", "first")
    assert log._server is not None
    monkeypatch.setattr(log, "checkpoint", _signer_down)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_served_child, args=(url, out))
    child.start()
    outcome = out.get(timeout=60)
    child.join(30)
    assert outcome == ("checkpoint", [1], "AuditSigningError"), outcome
    monkeypatch.undo()
    assert [e.resource for e in log.entries()] == ["first", "served"]
    assert log.verify().ok
    log.close()

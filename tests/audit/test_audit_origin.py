"""A writer keeps the log's origin (found while re-implementing the verifier from the docs).

The pipeline opens its log with ``origin="securetrain/<name>"``; ``securetrain audit export``,
``checkpoint`` and ``rotate-key`` open it with no origin. They used to sign the next checkpoint
(and hand-over) under the default origin ``securetrain.local/audit/…``, so the log held
checkpoints of two origins and every later export failed verification ("checkpoints come from
different logs"), permanently: stored checkpoints cannot be removed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.audit.errors import AuditConfigError
from securetrain.audit.export import verify_export
from securetrain.audit.keys import create_signing_key
from securetrain.audit.log import AuditLog


@pytest.fixture
def named_log(tmp_path: Path) -> tuple[Path, Path]:
    key = tmp_path / "k.pem"
    create_signing_key(key)
    db = tmp_path / "audit.db"
    log = AuditLog(db, signing_key=key, origin="securetrain/demo", shared_commit=False)
    log.record("dataset.read", "dataset:0")
    log.checkpoint()
    log.close()
    return db, key


def _origins(log: AuditLog) -> set[str]:
    return {cp.origin for cp in log.checkpoints()}


def test_writer_without_origin_takes_the_logs_origin(named_log: tuple[Path, Path], tmp_path: Path) -> None:
    db, key = named_log
    log = AuditLog(db, signing_key=key, shared_commit=False)  # as the `securetrain audit` commands open it
    try:
        assert log.origin == "securetrain/demo"
        log.record("checkpoint.decrypt", "step-1.stenc")
        out = log.export(tmp_path / "export")  # signs a checkpoint of the new entry
        assert _origins(log) == {"securetrain/demo"}
        report = verify_export(out, public_key=log.public_key)
        assert report.ok, report.error
    finally:
        log.close()


def test_rotation_by_a_writer_without_origin_keeps_the_origin(named_log: tuple[Path, Path], tmp_path: Path) -> None:
    db, key = named_log
    new = tmp_path / "new.pem"
    create_signing_key(new)
    log = AuditLog(db, signing_key=key, shared_commit=False)
    try:
        log.record("dataset.read", "dataset:1")
        handover = log.rotate_key(new)
        assert handover.origin == "securetrain/demo"
        log.record("dataset.read", "dataset:2")
        old_public = AuditLog(db, signing_key=key, shared_commit=False).public_key
        out = log.export(tmp_path / "export")
        assert _origins(log) == {"securetrain/demo"}
        report = verify_export(out, public_key=old_public)
        assert report.ok, report.error
    finally:
        log.close()


def test_configured_origin_that_differs_from_the_logs_is_refused(named_log: tuple[Path, Path]) -> None:
    db, key = named_log
    log = AuditLog(db, signing_key=key, origin="securetrain/other", shared_commit=False)
    try:
        log.record("dataset.read", "dataset:1")
        with pytest.raises(AuditConfigError, match="securetrain/demo"):
            log.checkpoint()
        assert _origins(log) == {"securetrain/demo"}  # nothing signed under the wrong origin
    finally:
        log.close()


def test_every_verifier_refuses_checkpoints_of_two_origins(tmp_path: Path) -> None:
    """The standalone verifier refused such a log; the library (`audit verify --db/--export`) accepted it."""
    import sqlite3
    import subprocess
    import sys

    from securetrain.audit.note import sign_checkpoint

    key = tmp_path / "k.pem"
    signer = create_signing_key(key)
    log = AuditLog(tmp_path / "audit.db", signing_key=key, origin="securetrain/a", shared_commit=False)
    try:
        for i in range(3):
            log.record("dataset.read", f"dataset:{i}")
        log.checkpoint()
        log.record("dataset.read", "dataset:3")
        # Same key, another origin: what an older writer opened without origin= stored.
        root = bytes.fromhex(log.consistency_proof(4, 4)["new_root"])
        other = sign_checkpoint("securetrain/b", 4, root, "securetrain/b", signer)
        with sqlite3.connect(tmp_path / "audit.db") as conn:
            conn.execute("INSERT INTO audit_checkpoints VALUES (?, ?, ?, ?)",
                         (4, root.hex(), "2026-12-05T00:00:00.000000Z", other.note))
        want = "checkpoints come from different logs: ['securetrain/a', 'securetrain/b']"
        report = log.verify()
        assert not report.ok and want in str(report.error), report.error
        out = log.export(tmp_path / "export", checkpoint=False)
        report = verify_export(out, public_key=log.public_key)
        assert not report.ok and want in str(report.error), report.error
        verifier = Path(__file__).resolve().parents[2] / "audit" / "verify_audit.py"
        proc = subprocess.run([sys.executable, "-I", str(verifier), str(out), "--trust-embedded-key"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and want in proc.stderr, proc.stderr
    finally:
        log.close()

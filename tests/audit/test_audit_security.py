"""Security items of issue 10 that concern the writer (each written to fail before its fix)."""

from __future__ import annotations

import os

from pathlib import Path

import pytest
from typer.testing import CliRunner

from securetrain.audit.log import AuditLog

REPO = Path(__file__).resolve().parents[2]


def test_mask_cli_with_finance_policy_and_auditing_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column names such as ``ssn`` must be recorded as values, not as detail keys."""
    from securetrain.cli.main import app
    from securetrain.masking.tabular.synthetic import write_finance_file

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    src = write_finance_file(tmp_path / "in.csv", n_rows=50)
    key = tmp_path / "mask.key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    db = tmp_path / "audit.db"
    result = CliRunner().invoke(app, ["mask", str(src), str(tmp_path / "out.csv"), "--policy",
                                      str(REPO / "policies" / "finance-pii.yaml"), "--key-file", str(key),
                                      "--audit-db", str(db)])
    assert result.exit_code == 0, result.output
    log = AuditLog(db, create=False)
    applied = [e for e in log.entries() if e.action == "mask.policy_applied"]
    assert len(applied) == 1 and applied[0].outcome == "success"
    columns = {a["column"] for a in applied[0].details["actions"]}
    assert "ssn" in columns or any("ssn" in c for c in columns)
    assert log.verify().ok
    log.close()


def _rewrite_history(db: Path, *, drop_checkpoints: bool) -> None:
    """A database-only attacker (no key): drops triggers, edits entry 2, re-chains, drops checkpoints."""
    import sqlite3

    from securetrain.audit import canonical
    from securetrain.audit.triggers import SQLITE_TRIGGER_NAMES

    conn = sqlite3.connect(db, isolation_level=None)
    for name in SQLITE_TRIGGER_NAMES:
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    rows = conn.execute("SELECT seq, ts, actor, hostname, mac, action, resource, outcome, details FROM audit_entries "
                        "ORDER BY seq").fetchall()
    prev = canonical.GENESIS_HASH
    import json

    for seq, ts, actor, host, mac, action, resource, outcome, details in rows:
        resource = "dataset:innocent" if seq == 2 else resource
        obj = canonical.entry_object(seq=seq, ts=ts, actor=actor, hostname=host, mac=mac, action=action,
                                     resource=resource, outcome=outcome, details=json.loads(details), prev_hash=prev)
        digest = canonical.sha256_hex(canonical.canonical_bytes(obj))
        conn.execute("UPDATE audit_entries SET resource=?, prev_hash=?, entry_hash=? WHERE seq=?",
                     (resource, prev, digest, seq))
        prev = digest
    if drop_checkpoints:
        conn.execute("DELETE FROM audit_checkpoints")
    conn.close()


def test_writer_refuses_to_sign_over_a_published_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows *and* checkpoint rows rewritten in the database: only the anchors still hold the truth."""
    from securetrain.audit.anchors import FileAnchor
    from securetrain.audit.errors import AuditIntegrityError
    from securetrain.audit.keys import load_or_create_signing_key

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    key = tmp_path / "audit-key.pem"
    load_or_create_signing_key(key)
    anchor = FileAnchor(tmp_path / "anchors.notes")
    db = tmp_path / "audit.db"
    with AuditLog(db, signing_key=key, anchors=[anchor], checkpoint_every=None) as log:
        for i in range(10):
            log.record("dataset.read", f"dataset:{i}")
        published = log.checkpoint()
    _rewrite_history(db, drop_checkpoints=True)
    fresh = AuditLog(db, signing_key=key, anchors=[anchor], checkpoint_every=None)  # a new writer process
    fresh.record("dataset.read", "dataset:10")
    with pytest.raises(AuditIntegrityError, match="rewritten"):
        fresh.checkpoint()
    assert fresh.checkpoints() == [] and len(anchor.notes()) == 1  # nothing was signed or published
    # deleting entries behind a published checkpoint is refused too
    import sqlite3

    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(f"DELETE FROM audit_entries WHERE seq >= {published.tree_size - 3}")
    conn.close()
    with pytest.raises(AuditIntegrityError, match="deleted"):
        fresh.checkpoint()
    fresh.close()


def test_bogus_checkpoint_row_is_refused_or_survived(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer-role insert of a bogus checkpoint row must not break checkpointing or verify()."""
    import sqlite3

    from securetrain.audit.keys import load_or_create_signing_key

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    key = tmp_path / "audit-key.pem"
    load_or_create_signing_key(key)
    db = tmp_path / "audit.db"
    log = AuditLog(db, signing_key=key, checkpoint_every=None)
    for i in range(5):
        log.record("dataset.read", f"dataset:{i}")
    log.checkpoint()
    log.record("dataset.read", "dataset:5")
    conn = sqlite3.connect(db, isolation_level=None)
    for size, root, note in [(10**6, "00" * 32, "x\n1000000\nAA==\n\n— x AAAA\n"),  # beyond the log
                             (6, "zz" * 32, "x\n6\nAA==\n\n— x AAAA\n")]:  # root not hex
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("INSERT INTO audit_checkpoints VALUES (?, ?, 't', ?)", (size, root, note))
    # a row consistent in size but with a signature nobody can check in SQL gets in...
    conn.execute("INSERT INTO audit_checkpoints VALUES (6, ?, 't', ?)", ("ab" * 32, "x\n6\nAA==\n\n— x AAAA\n"))
    conn.close()
    report = log.verify()  # ...verify() reports it rather than raising
    assert not report.ok
    cp = log.checkpoint()  # ...and checkpointing survives: an alert entry is recorded, then signed
    assert cp.tree_size == 7
    alert = list(log.entries())[-1]
    assert alert.action == "audit.alert" and alert.details["tree_size"] == 6
    log.close()


@pytest.mark.postgres
def test_postgres_checkpoint_rows_validated_on_insert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    psycopg = pytest.importorskip("psycopg")
    # Not `from conftest import ...`: with the whole suite collected that name resolves to another folder's conftest.
    postgres_url = os.environ.get("SECURETRAIN_TEST_postgres_url", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    libpq = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        psycopg.connect(libpq, connect_timeout=3).close()
    except psycopg.OperationalError:
        pytest.skip("PostgreSQL not reachable")
    from securetrain.audit.keys import load_or_create_signing_key

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    key = tmp_path / "audit-key.pem"
    load_or_create_signing_key(key)
    schema = f"st_audit_cp_{uuid.uuid4().hex[:10]}"
    log = AuditLog(postgres_url, schema=schema, signing_key=key, checkpoint_every=None)
    try:
        for i in range(5):
            log.record("dataset.read", f"dataset:{i}")
        good = log.checkpoint()
        log.record("dataset.read", "dataset:5")
        with psycopg.connect(libpq, autocommit=True) as conn:
            for size, root, note in [(10**6, "00" * 32, "x\n1000000\nAAAA\n\n— x AAAA\n"),
                                     (6, "ab" * 32, "x\n6\nAAAA\n\n— x AAAA\n"),  # root disagrees with the note
                                     (6, "zz" * 32, "x\n6\n!!\n\n— x AAAA\n")]:
                with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="append-only"):
                    conn.execute(f'INSERT INTO "{schema}".audit_checkpoints VALUES (%s, %s, %s, %s)',
                                 (size, root, "t", note))
        assert [c.tree_size for c in log.checkpoints()] == [good.tree_size]
        assert log.checkpoint().tree_size == 6 and log.verify().ok
    finally:
        log.close()
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

"""Hand-over look-ups use a partial index on ``audit.key_rotated`` entries (issue 10).

Logs created before the index existed get it when they are opened; a PostgreSQL writer role that
does not own the tables cannot create it and goes on without it (same results, a scan);
``provision_postgres`` creates it. Timings: benchmarks/audit_handover_lookup.py.
"""

from __future__ import annotations

import logging
import sqlite3
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.dialects import postgresql, sqlite

from conftest import POSTGRES_URL

from securetrain.audit.indexes import HANDOVER_INDEX
from securetrain.audit.log import AuditLog, handover_rows_query

LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


def _literal_sql(dialect) -> str:  # noqa: ANN001
    return str(handover_rows_query(0, 1 << 40).compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


def _twice_rotated(log: AuditLog, n: int = 5) -> list[str]:
    for i in range(n):
        log.record("dataset.read", f"dataset:{i}")
    log.rotate_key(Ed25519PrivateKey.generate())
    log.append_many([("dataset.read", f"dataset:{i}", "success", {"i": i}) for i in range(n)])
    log.rotate_key(Ed25519PrivateKey.generate())
    log.record("dataset.read", "dataset:last")
    return log.handover_notes()


def _sqlite_indexes(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")]


def test_sqlite_new_log_has_the_index_and_the_lookup_uses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    db = tmp_path / "audit.db"
    with AuditLog(db, signing_key=Ed25519PrivateKey.generate(), checkpoint_every=4) as log:
        notes = _twice_rotated(log)
    assert len(notes) == 2 and _sqlite_indexes(db) == [HANDOVER_INDEX]
    with sqlite3.connect(db) as conn:
        plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + _literal_sql(sqlite.dialect())))
    assert f"USING INDEX {HANDOVER_INDEX}" in plan, plan


def test_sqlite_existing_log_gets_the_index_on_open_with_the_same_hand_overs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    db = tmp_path / "audit.db"
    key = Ed25519PrivateKey.generate()
    with AuditLog(db, signing_key=key, checkpoint_every=4) as log:
        notes = _twice_rotated(log)
        current = log.signing_key
    with sqlite3.connect(db) as conn:  # a log written before the index existed
        conn.execute(f"DROP INDEX {HANDOVER_INDEX}")
    assert _sqlite_indexes(db) == []
    with AuditLog(db, signing_key=current, create=False) as log:  # read-only open: adds nothing
        assert log.handover_notes() == notes
    assert _sqlite_indexes(db) == []
    with AuditLog(db, signing_key=current) as log:
        assert _sqlite_indexes(db) == [HANDOVER_INDEX]
        assert log.handover_notes() == notes and log.handover_notes(stop=7) == notes[:1]
        log.record("dataset.read", "dataset:after")
        assert log.checkpoint().tree_size == log.size() and log.verify().ok
    with AuditLog(db, signing_key=current) as log:  # reopening is a no-op
        assert log.handover_notes() == notes
    assert _sqlite_indexes(db) == [HANDOVER_INDEX]


# -- PostgreSQL --------------------------------------------------------------------------------------
def _pg_has_index(schema: str) -> bool:
    psycopg = pytest.importorskip("psycopg")
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
                            (schema, HANDOVER_INDEX)).fetchone() is not None


def _pg_drop_index(schema: str) -> None:
    import psycopg

    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        conn.execute(f'DROP INDEX "{schema}".{HANDOVER_INDEX}')


@pytest.mark.postgres
def test_postgres_existing_log_gets_the_index_and_the_lookup_can_use_it(pg_schema: str) -> None:
    import psycopg

    with AuditLog(POSTGRES_URL, schema=pg_schema, signing_key=Ed25519PrivateKey.generate(), checkpoint_every=4) as log:
        notes = _twice_rotated(log)
        current = log.signing_key
    assert _pg_has_index(pg_schema)
    _pg_drop_index(pg_schema)
    with AuditLog(POSTGRES_URL, schema=pg_schema, signing_key=current) as log:  # the owner opens it
        assert _pg_has_index(pg_schema)
        assert log.handover_notes() == notes
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        conn.execute(f'SET search_path = "{pg_schema}"')
        conn.execute("SET enable_seqscan = off")  # a tiny table: only show that the predicate matches
        plan = " ".join(r[0] for r in conn.execute("EXPLAIN " + _literal_sql(postgresql.dialect())))
    assert HANDOVER_INDEX in plan, plan


@pytest.mark.postgres
def test_postgres_writer_role_without_owner_rights_skips_the_index_and_provision_creates_it(
        pg_schema: str, caplog: pytest.LogCaptureFixture) -> None:
    import psycopg

    from securetrain.audit.postgres import provision_postgres

    role = f"st_writer_{uuid.uuid4().hex[:8]}"
    provision_postgres(POSTGRES_URL, writer_role=role, schema=pg_schema, writer_password="writer-test-only")
    try:
        assert _pg_has_index(pg_schema)
        with AuditLog(POSTGRES_URL, schema=pg_schema, signing_key=Ed25519PrivateKey.generate(),
                      checkpoint_every=4) as owner:
            notes = _twice_rotated(owner)
            current = owner.signing_key
        _pg_drop_index(pg_schema)  # as if provisioned before the index existed
        writer_url = POSTGRES_URL.replace("postgres@", f"{role}:writer-test-only@")
        with caplog.at_level(logging.DEBUG, logger="securetrain.audit.indexes"):
            with AuditLog(writer_url, schema=pg_schema, signing_key=current, checkpoint_every=None) as writer:
                assert writer.handover_notes() == notes  # the same hand-overs, found by a scan
                writer.record("dataset.read", "dataset:by-writer")
                assert writer.checkpoint().tree_size == writer.size()
        assert not _pg_has_index(pg_schema)
        skipped = [r for r in caplog.records if r.name == "securetrain.audit.indexes"]
        assert skipped and all(r.levelno == logging.DEBUG for r in skipped), skipped
        provision_postgres(POSTGRES_URL, writer_role=role, schema=pg_schema)
        assert _pg_has_index(pg_schema)
    finally:
        with psycopg.connect(LIBPQ, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{pg_schema}" CASCADE')
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')

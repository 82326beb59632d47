"""AuditLog on PostgreSQL: triggers, least-privilege writer role, verification."""

from __future__ import annotations

import uuid

import pytest

psycopg = pytest.importorskip("psycopg")

from conftest import POSTGRES_URL  # noqa: E402

from securetrain.audit.errors import AuditError  # noqa: E402
from securetrain.audit.log import AuditLog  # noqa: E402
from securetrain.audit.postgres import provision_postgres  # noqa: E402

pytestmark = pytest.mark.postgres
LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def schema(pg_schema: str) -> str:
    return pg_schema


def test_postgres_roundtrip_and_tamper(schema: str) -> None:
    with AuditLog(POSTGRES_URL, schema=schema, actor="pg-test", checkpoint_every=5) as log:
        log.append_many([("train.start", f"run:{i}", "success", {"step": i}) for i in range(12)])
        assert log.size() == 12 and [c.tree_size for c in log.checkpoints()] == [12]
        held = log.checkpoint().note
        assert log.verify(trusted_checkpoints=[held]).ok
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            for sql in (f'UPDATE "{schema}".audit_entries SET actor = %s WHERE seq = 3',
                        f'DELETE FROM "{schema}".audit_entries WHERE seq = %s'):
                with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                    conn.execute(sql, ("x",) if "UPDATE" in sql else (11,))
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
                conn.execute(f'TRUNCATE "{schema}".audit_entries')
            with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="append-only"):
                conn.execute(f'INSERT INTO "{schema}".audit_entries SELECT * FROM "{schema}".audit_entries WHERE seq = 11 '
                             "ON CONFLICT (seq) DO NOTHING")
            # attacker with owner rights drops the triggers and edits history
            for t in ("no_change", "no_truncate", "insert_guard"):
                conn.execute(f'DROP TRIGGER audit_entries_{t} ON "{schema}".audit_entries')
            conn.execute(f"UPDATE \"{schema}\".audit_entries SET resource = 'run:evil' WHERE seq = 4")
        report = log.verify()
        assert not report.ok and report.error.seq == 4  # type: ignore[union-attr]
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            for t in ("no_change", "no_truncate", "insert_guard"):
                conn.execute(f'DROP TRIGGER audit_checkpoints_{t} ON "{schema}".audit_checkpoints')
            conn.execute(f'DELETE FROM "{schema}".audit_entries WHERE seq >= 4')
            conn.execute(f'DELETE FROM "{schema}".audit_checkpoints')
        assert log.verify().ok
        report = log.verify(trusted_checkpoints=[held])
        assert report.error is not None and report.error.problem == "truncated"


def test_writer_role_has_only_insert_and_select(schema: str) -> None:
    role = f"st_writer_{uuid.uuid4().hex[:8]}"
    provision_postgres(POSTGRES_URL, writer_role=role, schema=schema, writer_password="writer-test-only")
    provision_postgres(POSTGRES_URL, writer_role=role, schema=schema)  # idempotent
    try:
        writer_url = POSTGRES_URL.replace("postgres@", f"{role}:writer-test-only@")
        with AuditLog(writer_url, schema=schema, checkpoint_every=3) as log:
            for i in range(4):
                log.record("data.read", f"ds:{i}")
            assert log.verify().ok and log.checkpoints()
        with psycopg.connect(LIBPQ, autocommit=True) as admin:
            # Remove the triggers: only the grants stand between the writer and the rows now.
            for table in ("audit_entries", "audit_checkpoints"):
                for t in ("no_change", "no_truncate", "insert_guard"):
                    admin.execute(f'DROP TRIGGER {table}_{t} ON "{schema}".{table}')
            privs = admin.execute(
                "SELECT table_name, string_agg(privilege_type, ',' ORDER BY privilege_type) FROM "
                "information_schema.role_table_grants WHERE grantee = %s AND table_schema = %s GROUP BY table_name",
                (role, schema)).fetchall()
            assert dict(privs) == {"audit_entries": "INSERT,SELECT", "audit_checkpoints": "INSERT,SELECT"}
        with psycopg.connect(LIBPQ.replace("postgres@", f"{role}:writer-test-only@"), autocommit=True) as w:
            for sql in (f"UPDATE \"{schema}\".audit_entries SET actor = 'x'", f'DELETE FROM "{schema}".audit_entries',
                        f'TRUNCATE "{schema}".audit_entries', f'DELETE FROM "{schema}".audit_checkpoints',
                        f'DROP TABLE "{schema}".audit_entries',
                        f'CREATE TRIGGER x BEFORE INSERT ON "{schema}".audit_entries FOR EACH ROW EXECUTE FUNCTION "{schema}".audit_reject_change()'):
                with pytest.raises((psycopg.errors.InsufficientPrivilege,)):
                    w.execute(sql)
            assert w.execute(f'SELECT count(*) FROM "{schema}".audit_entries').fetchone() == (4,)
    finally:
        with psycopg.connect(LIBPQ, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_bad_schema_name_refused() -> None:
    with pytest.raises(Exception, match="schema"):
        AuditLog(POSTGRES_URL, schema="x; DROP TABLE y")
    with pytest.raises(AuditError):
        AuditLog("postgresql+psycopg://postgres@127.0.0.1:1/none", schema="s")


def test_append_reconnects_once_when_the_idle_writer_connection_was_closed(schema: str) -> None:
    """The writer keeps one connection (no pre-ping per append): a connection the server closed
    while idle fails in the first round trip, before anything is written, and is retried once."""
    with AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=None) as log:
        log.record("data.read", "ds:0")
        pid = log._pg_conn.info.backend_pid
        with psycopg.connect(LIBPQ, autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        entry = log.record("data.read", "ds:1")
        assert entry is not None and entry.seq == 1
        assert log._pg_conn.info.backend_pid != pid
        assert [e.seq for e in log.entries()] == [0, 1] and log.verify().ok


def test_refused_append_rolls_back_and_the_next_append_succeeds(schema: str) -> None:
    """A trigger refusal in the insert round trip is reported as such (never retried), the
    transaction is rolled back and the writer connection stays usable."""
    from securetrain.audit.errors import AuditRefusedError

    with AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=None) as log:
        log.record("data.read", "ds:0")
        pid = log._pg_conn.info.backend_pid
        real = log._chain_batch

        def forked(batch, head, view):  # noqa: ANN001, ANN202 - a writer bypassing the chain
            start, results, cols = real(batch, head, view)
            cols[9][0] = "f" * 64  # prev_hash of the first new row no longer links
            return start, results, cols

        log._chain_batch = forked  # type: ignore[method-assign]
        with pytest.raises(AuditRefusedError, match="append-only"):
            log.append_many([("data.read", "ds:1", "success", None), ("data.read", "ds:2", "success", None)])
        log._chain_batch = real  # type: ignore[method-assign]
        assert log.size() == 1
        assert log.record("data.read", "ds:3").seq == 1  # type: ignore[union-attr]
        assert log._pg_conn.info.backend_pid == pid  # rolled back, not dropped
        assert log.verify().ok


def test_command_events_go_to_the_schema_the_audit_cli_reads(schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SECURETRAIN_AUDIT_SCHEMA (the audit commands' --schema) also selects where other commands
    (--audit-db / SECURETRAIN_AUDIT_URL) record: they used to write the default schema, so
    `securetrain audit verify` of that schema found no log, or not their events."""
    from securetrain.audit.cli_support import command_recorder

    monkeypatch.setenv("SECURETRAIN_AUDIT_SCHEMA", schema)
    with command_recorder(POSTGRES_URL) as audit:
        audit.record("checkpoint.decrypt", "probe.stenc", details={"n": 1})
    with AuditLog(POSTGRES_URL, schema=schema, create=False) as log:
        assert [e.resource for e in log.entries()] == ["probe.stenc"]

"""Issue 10: on PostgreSQL each entry also carries the *server's* view of who wrote it and when.

Design (docs/audit-format.md, "What each field proves"): a ``server_view`` column (canonical JSON text:
``role`` = ``current_user``, ``addr`` = ``host(inet_client_addr())``, ``time`` = ``clock_timestamp()``) that
the writer reads once per append transaction, includes in the hashed object, and a BEFORE INSERT trigger
re-checks (role and address equal, time between ``now()`` and ``clock_timestamp()``), so a client cannot
assert another role, address or time. Absent on SQLite; old logs and exports without it still verify.
The first test was the failing-first specification (strict xfail until it passed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg")

from conftest import POSTGRES_URL  # noqa: E402

from securetrain.audit import canonical  # noqa: E402
from securetrain.audit.export import verify_export  # noqa: E402
from securetrain.audit.log import AuditLog  # noqa: E402
from securetrain.audit.triggers import postgres_ddl  # noqa: E402

pytestmark = [pytest.mark.postgres]
LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
VERIFIER = Path(__file__).resolve().parents[2] / "audit" / "verify_audit.py"
COLUMNS = "seq, ts, actor, hostname, mac, action, resource, outcome, details, prev_hash, entry_hash"


@pytest.fixture
def schema(pg_schema: str) -> str:
    return pg_schema


def test_postgres_entries_carry_a_server_asserted_view_the_chain_covers(schema: str) -> None:
    with AuditLog(POSTGRES_URL, schema=schema, actor="claims-to-be-alice") as log:
        log.record("data.read", "file:a")
        entry = next(iter(log.entries()))
        assert log.verify().ok
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        role = conn.execute("SELECT current_user").fetchone()[0]
        stored = conn.execute(f'SELECT server_view FROM "{schema}".audit_entries WHERE seq = 0').fetchone()[0]
        view = json.loads(stored)
        assert view["role"] == role  # the server's role, not the client-asserted actor
        assert {"role", "addr", "time"} <= set(view)
        assert entry.hashed_object().get("server_view") == view  # covered by the entry hash
        # A client forging the server's view is refused by the database itself.
        with pytest.raises(psycopg.Error):
            conn.execute(
                f'INSERT INTO "{schema}".audit_entries (seq, ts, actor, hostname, mac, action, resource, outcome, '
                "details, prev_hash, entry_hash, server_view) SELECT 1, ts, actor, hostname, mac, action, resource, "
                "outcome, details, entry_hash, repeat('0', 64), %s "
                f'FROM "{schema}".audit_entries WHERE seq = 0',
                (json.dumps({**view, "role": "auditor"}),))


def _standalone(export: Path, vkey: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", str(VERIFIER), str(export), "--vkey", vkey],
                          capture_output=True, text=True, timeout=120)


def _refresh_manifest(out: Path) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["entries.jsonl"] = canonical.sha256_hex((out / "entries.jsonl").read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest))


def _verdicts(log: AuditLog, out: Path) -> tuple[object, subprocess.CompletedProcess[str]]:
    return verify_export(out, public_key=log.public_key), _standalone(out, log.verifier_key())


def _server_role() -> str:
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        return conn.execute("SELECT current_user").fetchone()[0]


def test_batched_and_concurrent_appends_carry_the_view_and_exports_verify(schema: str, tmp_path: Path) -> None:
    """Group commit (several entries per transaction) and threads: one view per transaction, all accepted."""
    with AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=7, group_commit_window_s=0.005) as log:
        log.append_many([("data.read", f"file:{i}", "success", {"i": i}) for i in range(5)])
        threads = [threading.Thread(target=lambda t=t: [log.record("data.read", f"t{t}:{k}") for k in range(6)])
                   for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        entries = list(log.entries())
        assert len(entries) == 29 and log.verify().ok
        role = _server_role()
        times = []
        for e in entries:
            assert e.server_view is not None and e.server_view["role"] == role
            assert set(e.server_view) == {"role", "addr", "time"}
            assert e.hashed_object()["server_view"] == e.server_view
            times.append(e.server_view["time"])
        assert times == sorted(times)  # the lock orders transactions: server time never decreases along seq
        assert len({e.server_view["time"] for e in entries[:5]}) == 1  # append_many: one transaction, one view
        out = log.export(tmp_path / "exp")
        lines = (out / "entries.jsonl").read_bytes().splitlines()
        assert all(b'"server_view":{"addr":' in line for line in lines)
        report, standalone = _verdicts(log, out)
        assert report.ok and report.entries == 29, report.error
        assert standalone.returncode == 0, (standalone.stdout, standalone.stderr)


def test_tampering_with_the_server_view_is_detected(schema: str, tmp_path: Path) -> None:
    with AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=None) as log:
        for i in range(6):
            log.record("data.read", f"file:{i}")
        out = log.export(tmp_path / "exp")
        assert all(r.ok for r in [_verdicts(log, out)[0]])
        # In the export: another role claimed; server_view removed; a member added. The manifest is
        # no trust anchor, so the attacker fixes its digest.
        original = (out / "entries.jsonl").read_bytes()
        lines = original.splitlines(keepends=True)
        view = json.loads(lines[2])["server_view"]
        forged_role = json.loads(lines[2])
        forged_role["server_view"] = {**view, "role": "auditor"}
        removed = json.loads(lines[2])
        del removed["server_view"]
        extra = json.loads(lines[2])
        extra["server_view"] = {**view, "note": "x"}
        for name, obj in (("role", forged_role), ("removed", removed), ("extra", extra)):
            edited = lines.copy()
            edited[2] = canonical.canonical_bytes(obj) + b"\n"
            (out / "entries.jsonl").write_bytes(b"".join(edited))
            _refresh_manifest(out)
            report, standalone = _verdicts(log, out)
            assert not report.ok and report.error is not None and report.error.seq in (2, 3), (name, report.error)
            assert standalone.returncode == 1 and ("seq=2" in standalone.stderr or "seq=3" in standalone.stderr), \
                (name, standalone.stderr)
        # In the database, by someone who can drop the triggers (the table owner or a superuser).
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f'DROP TRIGGER audit_entries_no_change ON "{schema}".audit_entries')
            table = f'"{schema}".audit_entries'
            stored = conn.execute(f"SELECT server_view FROM {table} WHERE seq = 4").fetchone()[0]
            for bad in (json.dumps({**json.loads(stored), "role": "auditor"}, separators=(",", ":"), sort_keys=True),
                        None, stored.replace(",", ", "), "not json"):
                conn.execute(f"UPDATE {table} SET server_view = %s WHERE seq = 4", (bad,))
                report = log.verify()
                assert not report.ok and report.error is not None and report.error.seq == 4, (bad, report.error)
            conn.execute(f"UPDATE {table} SET server_view = %s WHERE seq = 4", (stored,))
        assert log.verify().ok  # the original text verifies again: only server_view was involved


def test_the_trigger_refuses_a_view_the_server_did_not_see(schema: str) -> None:
    with AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=None) as log:
        log.record("data.read", "file:a")
    table = f'"{schema}".audit_entries'
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        view = json.loads(conn.execute(f"SELECT server_view FROM {table} WHERE seq = 0").fetchone()[0])
        role, addr = view["role"], view["addr"]

        def insert(server_view: str | None, *, time_in_txn: bool = False) -> None:
            with conn.transaction():
                if time_in_txn:  # a correct time, read inside this transaction like the writer does
                    now = conn.execute("SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', "
                                       "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')").fetchone()[0]
                    server_view = server_view.replace("NOW", now) if server_view else server_view
                conn.execute(f"INSERT INTO {table} ({COLUMNS}, server_view) SELECT 1, ts, actor, hostname, mac, "
                             f"action, resource, outcome, details, entry_hash, repeat('0', 64), %s FROM {table} "
                             "WHERE seq = 0", (server_view,))
                raise _Rollback  # never keep a row: each case starts from the same head

        def ts(delta: timedelta) -> str:
            return canonical.utc_timestamp(datetime.now(UTC) + delta)

        def view_json(**kw: object) -> str:
            return json.dumps({"addr": addr, "role": role, "time": "NOW", **kw})

        refused = [
            None,  # no view at all (an old client, or one hiding it)
            "not json", "[]", json.dumps({"addr": addr, "role": role}),
            view_json(role="auditor"),  # another role
            view_json(addr="10.9.8.7"),  # another client address
            view_json(time=ts(timedelta(seconds=-30))),  # before this transaction began
            view_json(time=ts(timedelta(seconds=30))),  # in the future
            view_json(time="2026-01-01 00:00:00Z"),  # not the format of ts
            view_json(extra="x"),  # unchecked members could carry client claims
            view_json(role=1),
        ]
        for bad in refused:
            with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="server_view"):
                insert(bad, time_in_txn=True)
        with pytest.raises(_Rollback):  # the real view, read in the same transaction, is accepted
            insert(view_json(), time_in_txn=True)


class _Rollback(Exception):
    pass


OLD_GUARD = """CREATE OR REPLACE FUNCTION {s}.audit_entries_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE head_seq bigint; head_hash text;
BEGIN
  SELECT seq, entry_hash INTO head_seq, head_hash FROM {s}.audit_entries ORDER BY seq DESC LIMIT 1;
  IF NOT FOUND THEN head_seq := -1; head_hash := '{genesis}'; END IF;
  IF NEW.seq <> head_seq + 1 OR NEW.prev_hash <> head_hash THEN
    RAISE EXCEPTION 'audit_entries is append-only: seq must be max+1 and prev_hash must link'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$"""


def _create_pre_upgrade_log(schema: str, writer: str) -> None:
    """The schema, tables and triggers as securetrain created them before server_view existed."""
    s = f'"{schema}"'
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {s}")
        conn.execute(f"CREATE TABLE {s}.audit_entries (seq BIGINT PRIMARY KEY, ts VARCHAR(32) NOT NULL, "
                     "actor VARCHAR(256) NOT NULL, hostname VARCHAR(256) NOT NULL, mac VARCHAR(17) NOT NULL, "
                     "action VARCHAR(128) NOT NULL, resource VARCHAR(1024) NOT NULL, outcome VARCHAR(32) NOT NULL, "
                     "details TEXT NOT NULL, prev_hash VARCHAR(64) NOT NULL, entry_hash VARCHAR(64) NOT NULL)")
        conn.execute(f"CREATE TABLE {s}.audit_checkpoints (tree_size BIGINT PRIMARY KEY, root_hash VARCHAR(64) "
                     "NOT NULL, created_at VARCHAR(32) NOT NULL, note TEXT NOT NULL)")
        for stmt in postgres_ddl(schema):
            conn.execute(stmt)
        conn.execute(OLD_GUARD.format(s=s, genesis=canonical.GENESIS_HASH))
        conn.execute(f'CREATE ROLE "{writer}" LOGIN')
        conn.execute(f'GRANT USAGE ON SCHEMA {s} TO "{writer}"')
        conn.execute(f'GRANT SELECT, INSERT ON {s}.audit_entries, {s}.audit_checkpoints TO "{writer}"')


def test_entries_without_a_view_hash_exactly_as_before() -> None:
    # Pinned with the code before server_view existed: old entries' hashes (and exports) are unchanged.
    obj = canonical.entry_object(seq=7, ts="2026-01-01T00:00:00.000000Z", actor="alice", hostname="h",
                                 mac="aa:bb:cc:dd:ee:ff", action="data.read", resource="file:a", outcome="success",
                                 details={"rows": 3}, prev_hash="ab" * 32, server_view=None)
    assert "server_view" not in obj
    assert canonical.sha256_hex(canonical.canonical_bytes(obj)) == \
        "4b1054fa62059af678f67c30dbe79f9677b10f1596532cdce842ff7bd7aa7223"


def test_a_pre_upgrade_log_keeps_verifying_and_new_entries_get_the_view(
        schema: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = f"st_writer_{uuid.uuid4().hex[:8]}"
    writer_url = POSTGRES_URL.replace("postgres@", f"{writer}@")
    _create_pre_upgrade_log(schema, writer)
    try:
        # A writer role that does not own the tables cannot add the column: it warns and keeps
        # writing entries in the old form, which the old guard accepts.
        with AuditLog(writer_url, schema=schema, checkpoint_every=4) as log:
            log.append_many([("data.read", f"file:{i}", "success", None) for i in range(6)])
            assert all(e.server_view is None for e in log.entries())
            held = log.checkpoint().note
            assert log.verify().ok
        assert "predates server_view" in caplog.text
        # The owner opens it once: column and guard are upgraded in place; old rows keep NULL.
        with AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=4) as owner:
            owner.record("admin.upgrade", "audit:schema")
        with AuditLog(writer_url, schema=schema, checkpoint_every=4) as log:
            log.append_many([("data.read", f"file:new-{i}", "success", None) for i in range(3)])
            entries = list(log.entries())
            assert [e.server_view is None for e in entries] == [True] * 6 + [False] * 4
            assert entries[6].server_view["role"] == _server_role()  # type: ignore[index]
            assert {e.server_view["role"] for e in entries[7:]} == {writer}  # type: ignore[index]
            report = log.verify(trusted_checkpoints=[held])
            assert report.ok and report.trusted_verified == 1, report.error
            out = log.export(tmp_path / "exp")
            report, standalone = _verdicts(log, out)
            assert report.ok and report.entries == 10, report.error
            assert standalone.returncode == 0, (standalone.stdout, standalone.stderr)
        # After the upgrade the database refuses an entry without the server's view.
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="server_view"):
                conn.execute(f'INSERT INTO "{schema}".audit_entries ({COLUMNS}) SELECT 10, ts, actor, hostname, '
                             f"mac, action, resource, outcome, details, entry_hash, repeat('0', 64) "
                             f'FROM "{schema}".audit_entries WHERE seq = 9')
    finally:
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.execute(f'DROP OWNED BY "{writer}"')
            conn.execute(f'DROP ROLE IF EXISTS "{writer}"')


def test_cli_show_displays_the_server_view(schema: str) -> None:
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    with AuditLog(POSTGRES_URL, schema=schema, actor="claims-to-be-alice") as log:
        log.record("data.read", "file:a")
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        role = conn.execute("SELECT current_user").fetchone()[0]
    r = CliRunner().invoke(app, ["audit", "show", "--db", POSTGRES_URL, "--schema", schema, "--tail", "1"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "server role@addr" in r.output and f"{role}@" in r.output, r.output

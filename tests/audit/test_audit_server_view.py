"""Issue 10, open item: on PostgreSQL each entry also carries the *server's* view of who wrote it and when.

Failing-first specification, marked ``xfail(strict=True)`` until implemented (strict: the marker must be
removed once it passes). Proposed design, see the issue-10 report: a ``server_view`` column (JSON text:
``role`` = ``current_user``, ``addr`` = ``inet_client_addr()``, ``time`` = ``clock_timestamp()``) that the
writer reads inside its append transaction, includes in the hashed object, and a BEFORE INSERT trigger
re-checks (role and address equal, time between ``now()`` and ``clock_timestamp()``), so a client cannot
assert another role or an earlier time. Absent (null) on SQLite; old exports without it still verify.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg")

from conftest import POSTGRES_URL  # noqa: E402

from securetrain.audit.log import AuditLog  # noqa: E402

pytestmark = [pytest.mark.postgres,
              pytest.mark.xfail(strict=True, reason="issue 10: server-asserted identity/time not implemented yet")]
LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    try:
        psycopg.connect(LIBPQ, connect_timeout=3).close()
    except psycopg.OperationalError:
        pytest.skip(f"PostgreSQL not reachable at {LIBPQ}")
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    name = f"st_audit_srv_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


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

"""Secondary indexes of the audit log's tables.

``audit_entries`` is keyed by ``seq`` only. Key hand-overs (``audit.key_rotated`` entries) are
looked up by action on every open and rotation; without an index that reads every row. A *partial*
index holds only the hand-over rows, so appends (almost never a hand-over) pay nothing for it.
Queries must spell the action as a literal (not a bound parameter) for SQLite's planner, and
PostgreSQL's generic plans, to match the index predicate.
"""

from __future__ import annotations

import logging

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from securetrain.audit.handover import ROTATION_ACTION
from securetrain.audit.models import ENTRIES_TABLE

log = logging.getLogger(__name__)

HANDOVER_INDEX = "audit_entries_handover_idx"
# The SQL literal the index predicate and the look-up share (a constant: no quoting concerns).
HANDOVER_ACTION_SQL = f"'{ROTATION_ACTION}'"
HANDOVER_PREDICATE = f"action = {HANDOVER_ACTION_SQL}"


def handover_index_ddl(schema: str | None) -> str:
    table = f'"{schema}".{ENTRIES_TABLE}' if schema else ENTRIES_TABLE
    return f"CREATE INDEX IF NOT EXISTS {HANDOVER_INDEX} ON {table} (seq) WHERE {HANDOVER_PREDICATE}"


def has_handover_index(conn: Connection, backend: str, schema: str | None) -> bool:
    if backend == "sqlite":
        query = text("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :n")
    else:
        query = text("SELECT 1 FROM pg_indexes WHERE schemaname = :s AND indexname = :n").bindparams(s=schema)
    return conn.execute(query, {"n": HANDOVER_INDEX}).first() is not None


def ensure_handover_index(conn: Connection, backend: str, schema: str | None, *, strict: bool = False) -> bool:
    """Create the hand-over index if it is missing; True if it exists afterwards.

    PostgreSQL: only the table owner may create an index, and a least-privilege writer role
    (``provision_postgres``) is not the owner. Then, unless ``strict``, the look-up stays a scan
    (correct, only slower) and this returns False; the owner creates the index on its next open,
    or ``provision_postgres`` does. Run inside a transaction: a refusal is rolled back to a
    savepoint so the caller's transaction goes on.
    """
    if has_handover_index(conn, backend, schema):
        return True
    try:
        with conn.begin_nested():
            conn.exec_driver_sql(handover_index_ddl(schema))
    except DBAPIError as exc:
        from securetrain.audit.dberrors import classify
        from securetrain.audit.errors import AuditPermissionError

        err = classify(exc, backend=backend, operation="creating the audit hand-over index")
        if strict or not isinstance(err, AuditPermissionError):
            raise err from None
        log.debug("audit log %s: this role may not create index %s (not the table owner); hand-over look-ups "
                  "scan the table until the owner opens the log or runs provision_postgres", schema, HANDOVER_INDEX)
        return False
    return True

"""One-time PostgreSQL setup: schema, tables, triggers, indexes, and a writer role with INSERT+SELECT only.

Run as an administrator (the table owner). Writers connect as ``writer_role``; because they do not
own the tables they cannot drop the triggers, and the grants alone already refuse UPDATE, DELETE
and TRUNCATE.
"""

from __future__ import annotations

import re

from sqlalchemy import create_engine, text

from securetrain.audit.errors import AuditConfigError
from securetrain.audit.indexes import ensure_handover_index

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _ident(name: str, what: str) -> str:
    if not _IDENT.match(name):
        raise AuditConfigError(f"{what} {name!r} must match {_IDENT.pattern}")
    return f'"{name}"'


def provision_postgres(
    admin_url: str, *, writer_role: str = "securetrain_audit_writer", schema: str = "securetrain_audit",
    writer_password: str | None = None,
) -> None:
    """Create (idempotently) the log's schema and a least-privilege writer role."""
    from securetrain.audit.log import AuditLog

    role, sch = _ident(writer_role, "role"), _ident(schema, "schema")
    AuditLog(admin_url, schema=schema, create=True).close()  # the signing key is loaded lazily, never here
    engine = create_engine(admin_url)
    try:
        with engine.begin() as conn:
            exists = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": writer_role}).first()
            if not exists:
                conn.exec_driver_sql(f"CREATE ROLE {role} NOLOGIN")
            if writer_password is not None:
                # Parameters are not allowed in DDL; quote the literal safely via the server.
                quoted = conn.execute(text("SELECT quote_literal(:p)"), {"p": writer_password}).scalar_one()
                conn.exec_driver_sql(f"ALTER ROLE {role} LOGIN PASSWORD {quoted}")
            tables = f"{sch}.audit_entries, {sch}.audit_checkpoints"
            conn.exec_driver_sql(f"REVOKE ALL ON SCHEMA {sch} FROM PUBLIC")
            conn.exec_driver_sql(f"REVOKE ALL ON {tables} FROM PUBLIC")
            conn.exec_driver_sql(f"REVOKE ALL ON {tables} FROM {role}")
            conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA {sch} TO {role}")
            conn.exec_driver_sql(f"GRANT SELECT, INSERT ON {tables} TO {role}")
            # Writers are not the owner and cannot add indexes later: create them here (idempotent).
            ensure_handover_index(conn, "postgresql", schema, strict=True)
    finally:
        engine.dispose()


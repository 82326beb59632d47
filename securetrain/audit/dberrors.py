"""Map database driver errors to typed audit errors with an actionable hint.

Only a refusal by an append-only trigger or an integrity constraint is reported as possible
tampering; lost connections, lock timeouts and missing privileges are reported as what they are.
The message names the driver's error class and SQLSTATE, never row contents.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import DBAPIError

from securetrain.audit.errors import (
    AuditConnectionError,
    AuditDatabaseError,
    AuditLockTimeoutError,
    AuditPermissionError,
    AuditRefusedError,
)

# SQLSTATE classes / codes (PostgreSQL appendix A)
_PG_LOCK = {"55P03", "40P01", "40001"}  # lock_not_available, deadlock_detected, serialization_failure
_PG_CANCEL = {"57014"}  # query_canceled (statement_timeout / lock_timeout)
_PG_PERMISSION = {"42501", "28000", "28P01"}  # insufficient_privilege, invalid auth
_PG_CONNECTION_CLASSES = ("08", "57P", "53")  # connection exception, operator intervention, resources


def _sqlstate(orig: Any) -> str:
    return str(getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "")


def classify(exc: BaseException, *, backend: str, operation: str = "audit append") -> AuditDatabaseError:
    """Return the typed error for a SQLAlchemy/driver exception raised during ``operation``."""
    orig = getattr(exc, "orig", None) or exc
    name = type(orig).__name__
    msg = str(orig).splitlines()[0][:200] if str(orig) else ""
    state = _sqlstate(orig)
    tag = f"{name}{f' [{state}]' if state else ''}"
    lowered = msg.lower()

    if "append-only" in lowered:
        return AuditRefusedError(
            f"{operation} refused by an append-only trigger: {msg}",
            hint="the log may have been tampered with, or a writer bypassed the log's lock; "
                 "run 'securetrain audit verify'",
        )
    invalidated = isinstance(exc, DBAPIError) and exc.connection_invalidated
    if backend == "sqlite":
        if "locked" in lowered or "busy" in lowered:
            return AuditLockTimeoutError(
                f"{operation}: the SQLite write lock was not obtained in time ({tag})",
                hint="another process holds a long write transaction on the audit database; "
                     "raise busy_timeout_s or find the stuck writer",
            )
        if "readonly" in lowered or "read-only" in lowered or "permission" in lowered:
            return AuditPermissionError(
                f"{operation}: the audit database is not writable ({tag}: {msg})",
                hint="check the file and directory permissions of the audit database",
            )
        if "unable to open" in lowered or "disk i/o" in lowered or "no such table" in lowered:
            return AuditConnectionError(
                f"{operation}: cannot use the audit database file ({tag}: {msg})",
                hint="check the path (SECURETRAIN_AUDIT_URL / audit.url), free space and that the file exists",
            )
        if name == "IntegrityError":
            return AuditRefusedError(
                f"{operation} refused by a database constraint ({tag})",
                hint="the log may have been tampered with; run 'securetrain audit verify'",
            )
        return AuditDatabaseError(f"{operation} failed in the audit database ({tag}: {msg})",
                                  hint="nothing was recorded; retry, and check the database")

    # PostgreSQL
    if state in _PG_PERMISSION or name in ("InsufficientPrivilege", "InvalidAuthorizationSpecification"):
        return AuditPermissionError(
            f"{operation}: permission denied by PostgreSQL ({tag}: {msg})",
            hint="the writer role needs USAGE on the schema and SELECT, INSERT on its tables; "
                 "run provision_postgres() as the owner",
        )
    if state in _PG_LOCK or state in _PG_CANCEL or name in ("LockNotAvailable", "QueryCanceled"):
        return AuditLockTimeoutError(
            f"{operation}: timed out waiting for the audit log's lock ({tag})",
            hint="another writer holds a long transaction; check pg_stat_activity for a stuck session "
                 "or raise lock_timeout/statement_timeout",
        )
    if invalidated or state.startswith(_PG_CONNECTION_CLASSES) or name in (
        "OperationalError", "InterfaceError", "AdminShutdown", "ConnectionFailure", "ConnectionTimeout",
    ):
        return AuditConnectionError(
            f"{operation}: the connection to the audit database failed or was lost ({tag})",
            hint="check that PostgreSQL is up and reachable at the configured URL; nothing was recorded, "
                 "retrying is safe",
        )
    if state.startswith("23") or name.endswith("IntegrityConstraintViolation") or name == "UniqueViolation":
        return AuditRefusedError(
            f"{operation} refused by a database constraint ({tag})",
            hint="the log may have been tampered with, or a writer bypassed the log's lock; "
                 "run 'securetrain audit verify'",
        )
    return AuditDatabaseError(f"{operation} failed in the audit database ({tag})",
                              hint="nothing was recorded; retry, and check the database server's log")

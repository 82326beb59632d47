"""How every command records into the audit log: ``--audit-db`` or ``$SECURETRAIN_AUDIT_URL``.

Production sets ``SECURETRAIN_AUDIT_URL`` once, and every command (de-identification, masking,
key rotation, checkpoint decryption, HE evaluation) records what it did; ad-hoc use without it
records nothing rather than scattering stray databases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder

AUDIT_DB_OPTION = typer.Option(
    None,
    "--audit-db",
    envvar="SECURETRAIN_AUDIT_URL",
    help="Record this command's events in this audit log (URL or SQLite path; default $SECURETRAIN_AUDIT_URL).",
)


@contextlib.contextmanager
def command_recorder(audit_db: str | None) -> Iterator[AuditRecorder]:
    """The audit log named by ``audit_db`` (created if needed), or a recorder that records nothing.

    On PostgreSQL the schema is ``$SECURETRAIN_AUDIT_SCHEMA`` (what the audit commands' ``--schema``
    reads), else the default one, so a command's events land in the log ``securetrain audit`` checks.
    """
    if not audit_db:
        yield NullAuditRecorder()
        return
    import os

    from securetrain.audit.log import AuditLog

    with AuditLog(audit_db, schema=os.environ.get("SECURETRAIN_AUDIT_SCHEMA") or None) as log:
        yield log

"""Typed errors of the audit log.

Verification failures derive from :class:`~securetrain.errors.IntegrityError` so callers that treat
"tampering detected" generically keep working; they name the first bad entry (``seq``) and what is
wrong with it.
"""

from __future__ import annotations

from typing import Any

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError


class AuditError(SecureTrainError):
    """The audit log refused an operation (bad event, unusable database, missing key)."""


class AuditEventError(AuditError, ValueError):
    """An event cannot be recorded: non-JSON or float values, secret-shaped keys, too large."""


class AuditConfigError(AuditError, ConfigError):
    """The audit log is misconfigured (bad URL, unreadable or unsafe key file)."""


class AnchorError(AuditError):
    """A checkpoint could not be published to an external anchor."""


class AuditIntegrityError(AuditError, IntegrityError):
    """Verification failed: the log was altered, truncated, reordered or re-signed.

    ``seq`` is the first bad entry (``None`` when the problem is not tied to one entry, e.g. a bad
    checkpoint signature) and ``problem`` a short machine-friendly description.
    """

    def __init__(self, message: str, *, seq: int | None = None, problem: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.seq = seq
        self.problem = problem


class AuditDatabaseError(AuditError):
    """The database could not complete an audit operation. Subclasses say why.

    Nothing was recorded when this is raised from ``record()``/``append_many()``: the transaction
    was rolled back, so retrying is safe.
    """


class AuditConnectionError(AuditDatabaseError):
    """The connection to the audit database failed or was lost (server down, network, bad URL)."""


class AuditLockTimeoutError(AuditDatabaseError):
    """The log's write lock (SQLite ``BEGIN IMMEDIATE`` / PostgreSQL lock) was not obtained in time."""


class AuditPermissionError(AuditDatabaseError):
    """The database role or file permissions do not allow the operation."""


class AuditRefusedError(AuditDatabaseError):
    """An append-only trigger or constraint refused the write: a chain check failed in the database.

    This is the one database error that points at possible tampering (or a writer that bypassed
    the log's lock); run ``securetrain audit verify``.
    """

class AuditCheckpointError(AuditError):
    """The caller's entries were recorded (committed, durable), but the periodic checkpoint that
    their append was due to sign failed.

    ``entries`` are the caller's entries, already in the log: do not append them again (the error
    says so rather than leaving a retry to record them twice). ``__cause__`` says why the checkpoint
    failed, e.g. an :class:`AuditIntegrityError` (the log no longer reproduces a published
    checkpoint: tampering), an :class:`AuditSigningError` or an :class:`AnchorError`.
    """

    def __init__(self, message: str, *, entries: list[Any] | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.entries = list(entries or [])


class AuditExportError(AuditError):
    """An export directory is incomplete or unreadable (a file missing, not a directory)."""


class AuditSigningError(AuditError):
    """The checkpoint signer could not produce a valid signature (Vault unreachable or refusing, or
    a signature that does not verify with the signer's public key)."""

"""Tamper-evident audit log: hash chain + RFC 6962 Merkle tree + Ed25519-signed checkpoints.

Import the heavy pieces lazily: ``from securetrain.audit.log import AuditLog, open_audit_log``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AuditLog", "open_audit_log", "provision_postgres", "FileAnchor", "FsspecAnchor", "Anchor"]


def __getattr__(name: str) -> Any:  # keep `import securetrain.audit` cheap for the CLI
    if name in ("AuditLog", "open_audit_log", "AuditEntry"):
        from securetrain.audit import log

        return getattr(log, name)
    if name == "provision_postgres":
        from securetrain.audit.postgres import provision_postgres

        return provision_postgres
    if name in ("FileAnchor", "FsspecAnchor", "Anchor"):
        from securetrain.audit import anchors

        return getattr(anchors, name)
    raise AttributeError(name)

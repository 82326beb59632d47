"""The narrow interface other capabilities use to record audit events.

Capabilities depend on this protocol, not on the database-backed log, so they stay usable (and
testable) without a database: pass ``None`` or :class:`NullAuditRecorder` to record nothing.

``details`` must hold no PHI and no secrets: pseudonymous ids, digests, key ids, counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class AuditRecorder(Protocol):
    def record(
        self,
        action: str,
        resource: str,
        *,
        outcome: str = "success",
        details: Mapping[str, Any] | None = None,
    ) -> Any:
        """Append one event. ``action`` is dotted, e.g. ``"checkpoint.write"``."""
        ...


class NullAuditRecorder:
    """Records nothing; the default when no audit log is configured."""

    def record(
        self,
        action: str,
        resource: str,
        *,
        outcome: str = "success",
        details: Mapping[str, Any] | None = None,
    ) -> None:
        return None


class MemoryAuditRecorder:
    """Keeps events in a list; for tests and dry runs."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def record(
        self,
        action: str,
        resource: str,
        *,
        outcome: str = "success",
        details: Mapping[str, Any] | None = None,
    ) -> None:
        self.events.append(
            {"action": action, "resource": resource, "outcome": outcome, "details": dict(details or {})}
        )

"""The exception hierarchy shared by every capability.

Every error securetrain raises on purpose derives from :class:`SecureTrainError`, so callers
(the CLI, flows) can tell "bad input / refused for safety" from programming bugs. Messages say
what to do next and never contain secrets or PHI.
"""

from __future__ import annotations


class SecureTrainError(Exception):
    """Base class. ``hint`` is an optional next step for the user, shown by the CLI."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (hint: {self.hint})" if self.hint else base


class ConfigError(SecureTrainError):
    """A configuration or policy file is missing, malformed or invalid."""


class DeviceError(SecureTrainError):
    """The requested compute device is unknown or unavailable."""


class IntegrityError(SecureTrainError):
    """Data failed an integrity or authenticity check (tampering, truncation, wrong key)."""

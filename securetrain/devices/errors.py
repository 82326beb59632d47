"""Typed errors for device selection."""

from __future__ import annotations

from securetrain.errors import DeviceError


class UnknownBackendError(DeviceError):
    """An explicit backend name that no built-in or plugin backend provides."""


class BackendUnavailableError(DeviceError):
    """The backend exists but its hardware or runtime is not present on this machine."""

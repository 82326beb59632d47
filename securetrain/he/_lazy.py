"""Import TenSEAL only when it is needed, so securetrain works without the ``[he]`` extra."""

from __future__ import annotations

from types import ModuleType

from securetrain.he.errors import HEUnavailableError


def require_tenseal() -> ModuleType:
    try:
        import tenseal
    except ImportError as exc:  # pragma: no cover - exercised by monkeypatching in tests
        raise HEUnavailableError() from exc
    return tenseal

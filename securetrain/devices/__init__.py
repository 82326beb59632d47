"""Pluggable device backends: CPU, NVIDIA CUDA, Biren (torch_br/supa), any PrivateUse1 plugin.

>>> from securetrain.devices import resolve_backend
>>> backend = resolve_backend("auto")
>>> backend.device(), backend.autocast_dtype, backend.collective_backend

Names are imported lazily so that ``import securetrain.devices.cli`` (and ``securetrain --help``)
does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BackendDescription": "backend",
    "DeviceBackend": "backend",
    "AcceleratorBackend": "builtin",
    "BirenBackend": "builtin",
    "CpuBackend": "builtin",
    "CudaBackend": "builtin",
    "PrivateUse1Backend": "builtin",
    "BackendUnavailableError": "errors",
    "UnknownBackendError": "errors",
    "ENTRY_POINT_GROUP": "registry",
    "all_backends": "registry",
    "backend_names": "registry",
    "register_backend": "registry",
    "resolve_backend": "registry",
    "unregister_backend": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

"""Pluggable device backends: CPU, NVIDIA CUDA, Biren (torch_br/supa), any PrivateUse1 plugin.

>>> from securetrain.devices import resolve_backend
>>> backend = resolve_backend("auto")
>>> backend.device(), backend.autocast_dtype, backend.collective_backend

Names are imported lazily so that ``import securetrain.devices.cli`` (and ``securetrain --help``)
does not pay for importing torch.
"""

from __future__ import annotations

from securetrain._lazy import lazy_exports


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


__getattr__ = lazy_exports(__name__, _EXPORTS)

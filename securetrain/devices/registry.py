"""Backend registry and ``auto`` resolution.

Resolution order for ``auto`` (first match wins):

1. an installed vendor plugin: ``torch_br`` importable -> ``br``;
2. a renamed PrivateUse1 backend (``torch._C._get_privateuse1_backend_name() != "privateuseone"``)
   -> the registered backend whose ``device_type`` matches, else the generic ``privateuse1``;
3. ``torch.accelerator.current_accelerator()`` -> ``cuda`` for CUDA, else the generic ``accelerator``;
4. ``cpu``.

A step only wins if its backend reports itself available, so a broken plugin falls through to the
next step instead of crashing. An *explicit* choice never falls back: it is used or it fails with a
:class:`~securetrain.devices.errors.DeviceError` (fail closed: silently training on CPU when the
user asked for a GPU wastes hours and hides misconfiguration).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points

from securetrain.devices.backend import DeviceBackend
from securetrain.devices.builtin import (
    BIREN_PLUGIN,
    PRIVATEUSE1_DEFAULT,
    AcceleratorBackend,
    BirenBackend,
    CpuBackend,
    CudaBackend,
    PrivateUse1Backend,
    current_accelerator,
    plugin_installed,
    privateuse1_name,
)
from securetrain.devices.errors import BackendUnavailableError, UnknownBackendError
from securetrain.errors import DeviceError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "securetrain.devices"
AUTO = "auto"

BackendFactory = Callable[[int], DeviceBackend]

_BUILTIN: dict[str, BackendFactory] = {
    "cpu": CpuBackend,
    "cuda": CudaBackend,
    "br": BirenBackend,
    "privateuse1": PrivateUse1Backend,
    "accelerator": AcceleratorBackend,
}
_registered: dict[str, BackendFactory] = {}
_plugins_loaded = False


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Register a backend programmatically (entry points do this for installed packages)."""
    key = name.lower()
    if key == AUTO or not key.isidentifier():
        raise ValueError(f"invalid backend name {name!r}")
    if key in _BUILTIN:
        raise ValueError(f"backend name {name!r} is built in and cannot be replaced")
    if key in _registered and not replace:
        raise ValueError(f"backend {name!r} is already registered")
    _registered[key] = factory


def unregister_backend(name: str) -> None:
    """Remove a programmatically registered backend (built-ins cannot be removed)."""
    _registered.pop(name.lower(), None)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            factory = ep.load()
            if not callable(factory):
                raise TypeError("entry point is not callable")
            register_backend(ep.name, factory)
        except Exception as exc:
            # A broken third-party plugin must not take down device selection for everyone.
            log.warning("ignoring device backend plugin %r (%s): %s", ep.name, ep.value, exc)


def backend_names() -> list[str]:
    """Every backend name accepted by ``--device`` (plus ``auto``)."""
    _load_plugins()
    return [*_BUILTIN, *sorted(_registered)]


def _factory(name: str) -> BackendFactory:
    _load_plugins()
    key = name.lower()
    factory = _BUILTIN.get(key) or _registered.get(key)
    if factory is None:
        known = ", ".join([AUTO, *backend_names()])
        raise UnknownBackendError(f"unknown device backend {name!r}", hint=f"choose one of: {known}")
    return factory


def _instantiate(factory: BackendFactory, index: int, name: str = "") -> DeviceBackend:
    try:
        backend = factory(index)
    except Exception as exc:  # third-party factory: a typed error naming the cause, never a bare crash
        raise BackendUnavailableError(
            f"device backend {name or factory!r} could not be created: {type(exc).__name__}: {exc}",
            hint="fix or uninstall the plugin that provides it; `securetrain devices` lists every backend",
        ) from exc
    if not isinstance(backend, DeviceBackend):
        raise UnknownBackendError(f"backend factory {factory!r} did not return a DeviceBackend")
    return backend


class _UnusableBackend(DeviceBackend):
    """Stands in, in listings, for a registered backend whose factory failed."""

    def __init__(self, name: str, reason: str, index: int = 0) -> None:
        super().__init__(index)
        self.name = name
        self._reason = reason

    def availability(self) -> tuple[bool, str | None]:
        return False, self._reason

    @property
    def autocast_dtype(self) -> None:
        return None

    @property
    def collective_backend(self) -> str:
        return ""


def all_backends(index: int = 0) -> list[DeviceBackend]:
    """One instance of every known backend (available or not), for listing. A plugin whose factory
    fails is listed as unavailable with the failure as its reason, so one broken plugin does not hide
    the others (or crash ``securetrain devices``)."""
    backends: list[DeviceBackend] = []
    for name in backend_names():
        try:
            backends.append(_instantiate(_factory(name), index, name))
        except DeviceError as exc:
            backends.append(_UnusableBackend(name, str(exc.args[0]) if exc.args else str(exc), index))
    return backends


def _parse(choice: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``."""
    name, sep, idx = choice.strip().partition(":")
    if not sep:
        return name, 0
    if not idx.isdigit():
        raise UnknownBackendError(f"invalid device index in {choice!r}", hint="use NAME or NAME:INDEX, e.g. cuda:1")
    return name, int(idx)


def _auto_candidates(index: int) -> list[DeviceBackend]:
    candidates: list[DeviceBackend] = []
    if plugin_installed(BIREN_PLUGIN):
        candidates.append(BirenBackend(index))
    renamed = privateuse1_name()
    if renamed != PRIVATEUSE1_DEFAULT:
        # A plugin backend that claims this device type knows it better than the generic one.
        plugins = []
        for factory in _registered.values():
            try:
                plugins.append(_instantiate(factory, index))
            except Exception as exc:
                log.warning("ignoring device backend %r: %s", factory, exc)
        candidates.extend(b for b in plugins if b.device_type == renamed)
        candidates.append(PrivateUse1Backend(index))
    acc = current_accelerator()
    if acc is not None:
        candidates.append(CudaBackend(index) if acc.type == "cuda" else AcceleratorBackend(index))
    candidates.append(CpuBackend(index))
    return candidates


def resolve_backend(choice: str = AUTO, *, index: int | None = None) -> DeviceBackend:
    """The backend for ``choice`` (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"br"``, a plugin name).

    Raises :class:`UnknownBackendError` for unknown names and :class:`BackendUnavailableError`
    when an explicitly chosen backend is not usable here.
    """
    name, parsed_index = _parse(choice or AUTO)
    idx = parsed_index if index is None else index
    if name.lower() == AUTO:
        for candidate in _auto_candidates(idx):
            ok, reason = candidate.probe()
            if ok:
                return candidate
            log.debug("auto: skipping %s: %s", candidate.name, reason)
        return CpuBackend(idx)  # unreachable in practice: CPU is always available
    backend = _instantiate(_factory(name), idx, name)
    ok, reason = backend.probe()
    if not ok:
        raise BackendUnavailableError(
            f"device backend {backend.name!r} is not available: {reason}",
            hint="run `securetrain devices` to see what this machine offers, or use --device auto",
        )
    return backend

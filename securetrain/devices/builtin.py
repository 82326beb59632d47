"""Built-in backends: CPU, NVIDIA CUDA, Biren (``torch_br`` / ``supa``) and generic accelerators.

Vendor plugins are allowed to monkeypatch ``torch.cuda`` (torch_br does, so that CUDA-targeting code
"just runs" on Biren GPUs), so ``torch.cuda.is_available()`` alone is no proof of an NVIDIA GPU:
:class:`CudaBackend` also requires a CUDA (or ROCm) build of torch and a device name that is not a
Biren part.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import torch

from securetrain.devices.backend import DeviceBackend

PRIVATEUSE1_DEFAULT = "privateuseone"
BIREN_DEVICE_TYPE = "supa"
BIREN_PLUGIN = "torch_br"
# torch_br ships its own collective library; we use the name it registers with torch.distributed
# when present, else this default (see docs/devices.md).
BIREN_COLLECTIVE_CANDIDATES = ("sccl", "succl", "bccl")


def privateuse1_name() -> str:
    """The current (possibly renamed) PrivateUse1 device type, ``"privateuseone"`` if never renamed."""
    try:
        return str(torch._C._get_privateuse1_backend_name())
    except Exception:
        return PRIVATEUSE1_DEFAULT


def plugin_installed(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _device_module(device_type: str) -> Any | None:
    """``torch.<device_type>`` as registered by an out-of-tree plugin, if any."""
    return getattr(torch, device_type, None)


def _process_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class CpuBackend(DeviceBackend):
    name = "cpu"
    device_type = "cpu"
    batch_multiple = 1
    pin_memory = False  # pinning only helps host->accelerator copies

    def availability(self) -> tuple[bool, str | None]:
        return True, None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        # Decision: fp32 by default on CPU. bf16 autocast works (precision="bf16") but is slower than
        # fp32 on CPUs without AMX/AVX512-BF16 and changes numerics, so it is opt-in.
        return None

    @property
    def collective_backend(self) -> str:
        return "gloo"

    def memory_summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        rss = _process_rss_bytes()
        if rss is not None:
            summary["process_rss"] = rss
        try:
            summary["total"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            summary["free"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            pass
        return summary


def _looks_like_biren(name: str) -> bool:
    lowered = name.lower()
    return "biren" in lowered or lowered.startswith("br1")


class CudaBackend(DeviceBackend):
    name = "cuda"
    device_type = "cuda"
    batch_multiple = 8  # tensor-core friendly
    pin_memory = True

    def availability(self) -> tuple[bool, str | None]:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return False, "this torch build has no CUDA support (torch.version.cuda is None)"
        try:
            if not torch.cuda.is_available():
                return False, "no NVIDIA GPU visible (torch.cuda.is_available() is False)"
            count = torch.cuda.device_count()
            if count <= self.index:
                return False, (f"cuda:{self.index} requested but only {count} CUDA device(s) are visible "
                               f"(indices 0..{count - 1}; check CUDA_VISIBLE_DEVICES)")
            gpu = torch.cuda.get_device_name(self.index)
        except Exception as exc:
            return False, f"CUDA runtime error: {type(exc).__name__}"
        if _looks_like_biren(gpu) or BIREN_PLUGIN in sys.modules:
            return False, f"torch.cuda is provided by the Biren plugin ({gpu}); use --device br"
        return True, None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        try:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        except Exception:
            return torch.float16

    @property
    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32", "bf16", "fp16") if self.autocast_dtype == torch.bfloat16 else ("fp32", "fp16")

    @property
    def collective_backend(self) -> str:
        return "nccl"

    def memory_summary(self) -> dict[str, Any]:
        free, total = torch.cuda.mem_get_info(self.index)
        return {
            "allocated": torch.cuda.memory_allocated(self.index),
            "reserved": torch.cuda.memory_reserved(self.index),
            "peak_allocated": torch.cuda.max_memory_allocated(self.index),
            "free": free,
            "total": total,
        }

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)


class PrivateUse1Backend(DeviceBackend):
    """Any out-of-tree device registered through PrivateUse1 (renamed from ``privateuseone``).

    Uses ``torch.<name>`` (the module a plugin registers with ``torch._register_device_module``)
    for availability, memory and synchronisation when it provides them.
    """

    name = "privateuse1"
    batch_multiple = 1
    pin_memory = True

    def __init__(self, index: int = 0, device_type: str | None = None) -> None:
        super().__init__(index)
        self.device_type = device_type or privateuse1_name()

    def availability(self) -> tuple[bool, str | None]:
        if self.device_type == PRIVATEUSE1_DEFAULT:
            return False, "no out-of-tree device plugin has renamed the PrivateUse1 backend"
        if privateuse1_name() != self.device_type:
            return False, f"PrivateUse1 is registered as {privateuse1_name()!r}, not {self.device_type!r}"
        module = _device_module(self.device_type)
        probe = getattr(module, "is_available", None)
        if callable(probe):
            try:
                if not probe():
                    return False, f"torch.{self.device_type}.is_available() is False"
            except Exception as exc:
                return False, f"torch.{self.device_type}.is_available() failed: {type(exc).__name__}"
        return True, None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16

    @property
    def collective_backend(self) -> str:
        return "gloo"

    def memory_summary(self) -> dict[str, Any]:
        module = _device_module(self.device_type)
        summary: dict[str, Any] = {}
        for key, fn in (("allocated", "memory_allocated"), ("reserved", "memory_reserved")):
            probe = getattr(module, fn, None)
            if callable(probe):
                summary[key] = int(probe(self.index))
        return summary

    def synchronize(self) -> None:
        fn = getattr(_device_module(self.device_type), "synchronize", None)
        if callable(fn):
            fn()


class BirenBackend(PrivateUse1Backend):
    """Biren GPUs through the ``torch_br`` plugin, which registers PrivateUse1 as ``supa``."""

    name = "br"
    batch_multiple = 128  # BR1xx matrix units are fed best in multiples of 128 rows

    def __init__(self, index: int = 0) -> None:
        super().__init__(index, device_type=BIREN_DEVICE_TYPE)

    def availability(self) -> tuple[bool, str | None]:
        if not plugin_installed(BIREN_PLUGIN):
            return False, "the Biren plugin torch_br is not installed"
        try:
            importlib.import_module(BIREN_PLUGIN)  # registers the supa device on import
        except Exception as exc:
            return False, f"importing torch_br failed: {type(exc).__name__}: {exc}"
        return super().availability()

    @property
    def collective_backend(self) -> str:
        # Only a collective torch_br actually registered; never a name init_process_group would reject.
        for candidate in BIREN_COLLECTIVE_CANDIDATES:
            if collective_available(candidate):
                return candidate
        return "gloo"


def collective_available(name: str) -> bool:
    """Whether ``torch.distributed`` has a process-group backend registered under ``name``."""
    try:
        import torch.distributed as dist

        probe = getattr(dist, "is_backend_available", None)
        if callable(probe):
            return bool(probe(name))
        return name.lower() in {b.lower() for b in dist.Backend.backend_list}
    except Exception:
        return False


class AcceleratorBackend(DeviceBackend):
    """Fallback for in-tree accelerators torch reports via ``torch.accelerator`` (xpu, mps, ...)."""

    name = "accelerator"
    batch_multiple = 8
    pin_memory = True

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        acc = current_accelerator()
        self.device_type = acc.type if acc is not None else "none"

    def availability(self) -> tuple[bool, str | None]:
        if self.device_type == "none":
            return False, "torch.accelerator reports no accelerator"
        return True, None

    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16

    @property
    def collective_backend(self) -> str:
        return {"xpu": "xccl"}.get(self.device_type, "gloo")

    def synchronize(self) -> None:
        try:
            torch.accelerator.synchronize(self.index)
        except Exception:
            pass


def current_accelerator() -> torch.device | None:
    try:
        if torch.accelerator.is_available():
            return torch.accelerator.current_accelerator()
    except Exception:
        return None
    return None

"""The interface every device backend implements.

A backend answers the questions the training engine would otherwise hard-code per vendor: which
``torch.device`` to use, which autocast dtype, which ``torch.distributed`` backend, how to pad batch
sizes, whether to pin host memory. Third parties subclass :class:`DeviceBackend` and register it
under the ``securetrain.devices`` entry-point group.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from securetrain.cpus import usable_cpus


@dataclass(frozen=True)
class BackendDescription:
    """A plain, JSON-friendly snapshot of a backend (what ``securetrain devices`` prints)."""

    name: str
    available: bool
    device: str | None
    autocast_dtype: str | None
    supported_precisions: tuple[str, ...]
    collective_backend: str | None
    batch_multiple: int
    pin_memory: bool
    memory: dict[str, Any]
    reason: str | None = None  # why it is unavailable

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "device": self.device,
            "autocast_dtype": self.autocast_dtype,
            "supported_precisions": list(self.supported_precisions),
            "collective_backend": self.collective_backend,
            "batch_multiple": self.batch_multiple,
            "pin_memory": self.pin_memory,
            "memory": self.memory,
            "reason": self.reason,
        }


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


class DeviceBackend(abc.ABC):
    """One kind of compute device. Instances are cheap; probing happens in :meth:`availability`."""

    #: Registry name (``--device NAME``).
    name: str = ""
    #: ``torch.device(...).type`` this backend drives.
    device_type: str = ""
    #: Round batch sizes up to a multiple of this for good hardware utilisation.
    batch_multiple: int = 1
    #: Whether DataLoaders should pin host memory (worth it only when copying to an accelerator).
    pin_memory: bool = False

    def __init__(self, index: int = 0) -> None:
        self.index = index

    # --- probing -------------------------------------------------------------------------
    @abc.abstractmethod
    def availability(self) -> tuple[bool, str | None]:
        """``(True, None)`` if usable, else ``(False, reason)``. Must never raise."""

    def probe(self) -> tuple[bool, str | None]:
        """:meth:`availability`, with a backend that breaks its never-raise contract reported as
        unavailable (the exception type and message as the reason) instead of crashing the caller."""
        try:
            ok, reason = self.availability()
        except Exception as exc:  # third-party code: one broken plugin must not break listing or auto
            return False, f"{type(self).__name__}.availability() raised {type(exc).__name__}: {exc}"
        return bool(ok), reason

    def is_available(self) -> bool:
        return self.probe()[0]

    # --- what the engine asks ------------------------------------------------------------
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index) if self.device_type != "cpu" else torch.device("cpu")

    @property
    @abc.abstractmethod
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype that ``precision="auto"`` autocasts to; ``None`` means plain fp32 (no autocast)."""

    @property
    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32", "bf16", "fp16")

    @property
    @abc.abstractmethod
    def collective_backend(self) -> str:
        """Name passed to ``torch.distributed.init_process_group(backend=...)``."""

    def memory_summary(self) -> dict[str, Any]:
        """Memory figures in bytes (keys vary by backend); empty when the runtime reports none."""
        return {}

    def synchronize(self) -> None:
        """Block until queued device work is done (needed for honest timings)."""
        return None

    def describe(self) -> BackendDescription:
        ok, reason = self.probe()
        memory: dict[str, Any] = {}
        device = None
        if ok:
            device = str(self.device())
            try:
                memory = self.memory_summary()
            except Exception as exc:  # a flaky driver query must not break `securetrain devices`
                memory = {"error": type(exc).__name__}
        return BackendDescription(
            name=self.name,
            available=ok,
            device=device,
            autocast_dtype=dtype_name(self.autocast_dtype) if ok else None,
            supported_precisions=self.supported_precisions if ok else (),
            collective_backend=self.collective_backend,
            batch_multiple=self.batch_multiple,
            pin_memory=self.pin_memory,
            memory=memory,
            reason=reason,
        )

    #: Upper bound on the DataLoader workers :meth:`loader_workers` advises per rank.
    max_loader_workers: int = 8

    def loader_workers(self, procs_per_node: int = 1) -> int:
        """Advised DataLoader ``num_workers`` per rank: ~70% of this process's cores shared by the
        node's ranks, capped at :attr:`max_loader_workers`; 0 for host-only (CPU) training, where
        loader workers would compete with the compute for the same cores."""
        if self.device_type == "cpu":
            return 0
        cores = usable_cpus()
        return max(0, min(self.max_loader_workers, int(0.7 * cores / max(1, procs_per_node))))

    def round_batch_size(self, batch_size: int) -> int:
        """``batch_size`` rounded up to :attr:`batch_multiple`."""
        m = max(1, self.batch_multiple)
        return -(-batch_size // m) * m

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} -> {self.device_type}:{self.index}>"

"""``torch.distributed`` plumbing for ``torchrun`` launches (env:// rendezvous)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # we initialised the process group, so we tear it down
    device: torch.device = torch.device("cpu")  # where collective tensors live (cuda for nccl)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def any_flag(self, flag: bool) -> bool:
        """True if ``flag`` is set on any rank (so every rank stops at the same step)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def from_env() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` as set by torchrun; ``(0, 0, 1)`` when not launched by it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world


def init_distributed(collective_backend: str) -> DistContext:
    rank, local_rank, world = from_env()
    if world <= 1:
        return DistContext()
    if dist.is_initialized():
        return DistContext(dist.get_rank(), local_rank, dist.get_world_size(), owns_group=False)
    dist.init_process_group(backend=collective_backend, init_method="env://", rank=rank, world_size=world)
    return DistContext(rank, local_rank, world, owns_group=True)

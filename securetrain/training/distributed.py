"""``torch.distributed`` plumbing for ``torchrun`` launches (env:// rendezvous)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: How long a rank that ended normally waits at teardown for the others (then tears down anyway).
TEARDOWN_TIMEOUT_S = 120.0


@dataclass
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # we initialised the process group, so we tear it down
    device: torch.device = torch.device("cpu")  # where collective tensors live (cuda for nccl)
    teardown_timeout_s: float = TEARDOWN_TIMEOUT_S

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

    def close(self, *, clean: bool = True) -> None:
        """Tear down the process group we created: on every rank, on every path.

        ``clean`` (this rank ended normally): first wait, at most ``teardown_timeout_s``, until
        every rank got here, so no rank tears down its connections while a peer is still in a
        collective with it. After an error (``clean=False``) there is no wait: a peer that died
        would never arrive, and a barrier would hang the survivors. The group is destroyed either
        way (a process that exits without it can abort in gloo's threads at exit).
        """
        if not (self.owns_group and dist.is_initialized()):
            return
        self.owns_group = False
        try:
            if clean and self.enabled:
                self._teardown_barrier()
        finally:
            dist.destroy_process_group()

    def _teardown_barrier(self) -> None:
        try:
            # async + wait(timeout): a plain barrier would wait the process group's timeout (30 min).
            work = dist.barrier(async_op=True)
            if work is not None and work.wait(timedelta(seconds=self.teardown_timeout_s)) is False:
                raise TimeoutError(f"not every rank arrived within {self.teardown_timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - teardown goes on; the peers' own errors say why
            log.warning("rank %d: teardown barrier failed (%s: %s); destroying the process group anyway",
                        self.rank, type(exc).__name__, exc)


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


def exit_process(code: int) -> NoReturn:
    """End the rank without interpreter and C++ static teardown.

    ``destroy_process_group()`` does not stop gloo's threads while anything still holds the
    process group: an FSDP2 model does (its parameters' autograd hooks, held from C++, reach the
    group through FSDP's mesh info), so they are still running when the process exits, and
    tearing the process down around them can abort the rank ("terminate called without an active
    exception"; pytorch/pytorch PR 179291). The work is done and durable here, so do what a
    normal exit does in Python (wait for non-daemon Python threads, run the ``atexit`` handlers:
    logging, the audit log's flush, multiprocessing's children), flush stdio, and leave with
    ``os._exit``: no module teardown, no C++ static destructors under running threads.
    """
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

"""Run under ``python -m torch.distributed.run --nproc_per_node=2 --standalone ddp_closure_worker.py OUTDIR``.

LBFGS (a closure optimizer) under DDP: each rank sees other samples, so its local loss differs; the
trainer's closure all-reduces the loss, so LBFGS takes the same decisions (tolerance checks, number
of closure calls) on every rank. Writes ``OUTDIR/<run>/rank<R>.txt`` = digest, steps, reason for an
uninterrupted run and one preempted after 2 steps and resumed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tensor_digest import digest

from securetrain.training import Trainer, TrainerCallback, TrainingConfig
from securetrain.training.distributed import exit_process
from securetrain.training.synthetic import SyntheticClassification, make_mlp


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, trainer, metrics) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
        if metrics.step == self.step:
            trainer.request_stop()


def train(out: Path, rank: int, stop: int | None = None) -> None:
    data = SyntheticClassification(samples=64, features=8, classes=3, seed=5)
    model = make_mlp(8, 3, hidden=8, dropout=0.1, seed=rank)
    cfg = TrainingConfig(epochs=2, batch_size=8, grad_accumulation=2, seed=3, output_dir=out, log_every=1,
                         device="cpu", grad_clip=None, stop_check_every=1)
    callbacks = [StopAt(stop)] if stop is not None and rank == 0 else []
    result = Trainer(model, data, cfg, optimizer=lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3),
                     callbacks=callbacks).fit()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.txt").write_text(f"{digest(model)} {result.steps} {result.reason}\n")


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    train(out / "full", rank)
    train(out / "resumed", rank, stop=2)
    (out / "resumed" / f"rank{rank}.txt").rename(out / "resumed" / f"first{rank}.txt")
    train(out / "resumed", rank)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())

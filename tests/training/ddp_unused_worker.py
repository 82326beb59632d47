"""Run under ``python -m torch.distributed.run --nproc_per_node=2 --standalone ddp_unused_worker.py OUTDIR``.

A user's model with a parameter its loss never uses (an auxiliary head): DDP without
``find_unused_parameters`` must stop with a TrainingError that names the setting, and with it the
run completes. Each rank writes ``OUTDIR/rank<R>.txt``: the first run's error type, then the
second run's reason and steps.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from securetrain.training import Trainer, TrainingConfig, TrainingError
from securetrain.training.distributed import exit_process


class WithAuxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.aux = nn.Linear(4, 2)  # trainable, never used by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    lines = []
    try:
        Trainer(WithAuxHead(), data, TrainingConfig(epochs=1, batch_size=4, output_dir=out / "plain")).fit()
        lines.append("no error")
    except TrainingError as exc:
        lines.append(f"TrainingError {'find_unused_parameters' in (exc.hint or '')}")
    dist.barrier()
    cfg = TrainingConfig(epochs=1, batch_size=4, output_dir=out / "found", find_unused_parameters=True)
    result = Trainer(WithAuxHead(), data, cfg).fit()
    lines.append(f"{result.reason} {result.steps}")
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())

"""Run under ``python -m torch.distributed.run --nproc_per_node=2 --standalone ddp_worker.py OUTDIR``.

One launch (process start-up dominates the cost) does three trainings on the same process group:
``OUTDIR/full`` uninterrupted; ``OUTDIR/resumed`` stopped after 3 steps, then resumed by a fresh
Trainer and model. Each rank writes ``<run>/rank<R>.sha256`` = digest of its final weights, steps,
reason. Rank 0 alone writes checkpoints.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tensor_digest import digest

from securetrain.training import Trainer, TrainingConfig
from securetrain.training.distributed import exit_process
from securetrain.training.synthetic import SyntheticClassification, make_mlp


def train(out: Path, rank: int, max_steps: int | None = None, init_seed: int = 0) -> None:
    data = SyntheticClassification(samples=100, features=10, classes=3, seed=5)  # 100 % (2 ranks * 8): padding
    model = make_mlp(10, 3, hidden=16, dropout=0.1, seed=rank + init_seed)  # DDP must broadcast rank 0's
    cfg = TrainingConfig(
        epochs=2, batch_size=8, grad_accumulation=2, seed=3, output_dir=out, checkpoint_every=4, log_every=2,
        max_steps=max_steps,
    )
    result = Trainer(model, data, cfg).fit()
    (out / f"rank{rank}.sha256").write_text(f"{digest(model)} {result.steps} {result.reason}\n")


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # pre-initialised group: the Trainer must reuse it, not tear it down
    rank = int(os.environ["RANK"])
    train(out / "full", rank)
    train(out / "resumed", rank, max_steps=3)
    train(out / "resumed", rank, init_seed=100)  # fresh, differently initialised model: resume overwrites it
    assert dist.is_initialized()
    dist.barrier()  # no rank tears down its connections while a peer is still in a collective
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # As the pipeline's ranks end: gloo's threads may outlive destroy_process_group() (an FSDP2
    # model keeps the group), and interpreter teardown around them can abort the rank.
    exit_process(main())

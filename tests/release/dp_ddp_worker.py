"""Run under ``python -m torch.distributed.run --nproc_per_node=2 --standalone dp_ddp_worker.py OUTDIR``.

DP-SGD on two ranks: ``OUTDIR/full`` uninterrupted; ``OUTDIR/resumed`` stopped after 3 steps and
resumed by a fresh trainer. Each rank writes ``<run>/rank<R>.json``: weights digest, steps, reason, ε.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from securetrain.release.privacy import DPTrainer
from securetrain.training import TrainingConfig
from securetrain.training.distributed import exit_process
from securetrain.training.synthetic import SyntheticClassification, make_mlp

warnings.simplefilter("ignore")


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(out: Path, rank: int, max_steps: int | None = None) -> None:
    data = SyntheticClassification(samples=120, features=10, classes=3, seed=5)
    model = make_mlp(10, 3, hidden=16, dropout=0.0, seed=rank)  # DPDDP must broadcast rank 0's
    cfg = TrainingConfig(epochs=2, batch_size=6, grad_accumulation=2, seed=3, output_dir=out, log_every=1,
                         max_steps=max_steps, precision="fp32", checkpoint_every=3,
                         privacy={"target_epsilon": 3.0, "delta": 1e-3, "plan_epochs": 2})
    trainer = DPTrainer(model, data, cfg, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    result = trainer.fit()
    (out / f"rank{rank}.json").write_text(json.dumps({
        "digest": digest(trainer.model), "steps": result.steps, "reason": result.reason,
        "epsilon": result.privacy["epsilon"], "sample_rate": result.privacy["sample_rate"]}))


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(out / "full", rank)
    train(out / "resumed", rank, max_steps=3)
    train(out / "resumed", rank)
    dist.barrier()  # no rank tears down its connections while a peer is still in a collective
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # As the pipeline's ranks end: gloo's threads may outlive destroy_process_group() (an FSDP2
    # model keeps the group), and interpreter teardown around them can abort the rank.
    exit_process(main())

"""Run under ``python -m torch.distributed.run --nproc_per_node=2 --standalone fsdp_worker.py OUTDIR``.

FSDP2 (``strategy="fsdp"``) on 2 gloo ranks, checkpoints in the encrypted store ($SECURETRAIN_KEK):
``OUTDIR/full`` uninterrupted; ``OUTDIR/resumed`` stopped after 3 steps, then resumed by a fresh
Trainer and a differently initialised model. Each rank writes ``<run>/rank<R>.sha256`` = digest of
its local shards, steps, reason; rank 0 also ``<run>/full.sha256`` = digest of the gathered weights.
``OUTDIR/tied`` and ``OUTDIR/tied-resumed`` do the same with :class:`TiedNet` (an output projection
that is the embedding matrix); their rank files add whether the tie held after training.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tensor_digest import digest_tensors as digest
from tied_net import TiedNet
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from securetrain.crypto.checkpoint import EncryptedCheckpointStore
from securetrain.training import Trainer, TrainingConfig
from securetrain.training.distributed import exit_process
from securetrain.training.synthetic import SyntheticClassification, make_mlp


def train(out: Path, rank: int, max_steps: int | None = None, init_seed: int = 0, tied: bool = False) -> None:
    data = SyntheticClassification(samples=100, features=10, classes=3, seed=5)
    held_out = SyntheticClassification(samples=30, features=10, classes=3, seed=6)
    # rank 0's init must win
    model = TiedNet(rank + init_seed) if tied else make_mlp(10, 3, hidden=16, dropout=0.1, seed=rank + init_seed)
    cfg = TrainingConfig(
        epochs=2, batch_size=8, grad_accumulation=2, seed=3, output_dir=out, checkpoint_every=4, log_every=2,
        max_steps=max_steps, strategy="fsdp", stop_check_every=2,
    )
    best = EncryptedCheckpointStore.from_env(out / "best", keep_last=1)
    result = Trainer(model, data, cfg, eval_data=held_out, best_store=best).fit()
    local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in model.state_dict().items()}
    tie = f" {model.head.weight is model.embed.weight}" if tied else ""
    (out / f"rank{rank}.sha256").write_text(f"{digest(local)} {result.steps} {result.reason}{tie}\n")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        (out / "full.sha256").write_text(digest(full) + "\n")


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    train(out / "full", rank)
    train(out / "resumed", rank, max_steps=3)
    train(out / "resumed", rank, init_seed=100)
    train(out / "tied", rank, tied=True)
    train(out / "tied-resumed", rank, max_steps=3, tied=True)
    train(out / "tied-resumed", rank, init_seed=100, tied=True)
    dist.barrier()  # no rank tears down its connections while a peer is still in a collective
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # As the pipeline's ranks end: gloo's threads may outlive destroy_process_group() (an FSDP2
    # model keeps the group), and interpreter teardown around them can abort the rank.
    exit_process(main())

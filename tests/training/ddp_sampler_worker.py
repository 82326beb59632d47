"""Run under ``python -m torch.distributed.run --nproc_per_node=2 --standalone ddp_sampler_worker.py OUTDIR``.

DataLoaders with a (batch) sampler of the user's own under DDP. Each run writes
``OUTDIR/<run>/rank<R>.json``: the dataset indices this rank read, in order, the digest of its final
weights, steps and reason (or the error it stopped with).

- ``sampler`` / ``resumed``: a sampler of the even indices, shuffled per epoch from torch's global
  RNG, uninterrupted and stopped after 3 steps then resumed by a fresh model;
- ``batches``: a batch sampler grouping indices by label;
- ``sharded``: a sampler that shards itself (``num_replicas``/``rank``), used as is;
- ``unseeded``: a sampler seeded from the OS (another order on each rank), refused.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensor_digest import digest
from torch.utils.data import DataLoader, Dataset, Sampler

from securetrain.training import Trainer, TrainingConfig
from securetrain.training.distributed import exit_process
from securetrain.training.synthetic import make_mlp

N = 80
G = torch.Generator().manual_seed(0)
X = torch.randn(N, 6, generator=G)
Y = torch.randint(0, 3, (N,), generator=G)


class Recorded(Dataset):
    def __init__(self) -> None:
        self.read: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        self.read.append(int(i))
        return X[i], Y[i]


class ShuffledEvens(Sampler[int]):
    """The even indices, in an order drawn from torch's global RNG (what the trainer seeds per epoch)."""

    def __len__(self) -> int:
        return N // 2

    def __iter__(self) -> Iterator[int]:
        return iter((torch.randperm(N // 2) * 2).tolist())


class ByLabel(Sampler[list[int]]):
    """Batches of 4 indices of one label each, batches shuffled (a bucketing batch sampler)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        out = []
        for label in range(3):
            idx = [i for i in range(N) if int(Y[i]) == label]
            out += [idx[k : k + 4] for k in range(0, len(idx), 4)]
        return out

    def __len__(self) -> int:
        return len(self._batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        g = torch.Generator().manual_seed(1000 + self.epoch)
        return iter([batches[i] for i in torch.randperm(len(batches), generator=g).tolist()])


class OwnShard(Sampler[int]):
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.num_replicas = rank, world

    def __len__(self) -> int:
        return N // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, N, self.num_replicas))


class Unseeded(Sampler[int]):
    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.seed()  # from the OS: another order on every rank
        return iter(torch.randperm(N, generator=g).tolist())


def train(out: Path, rank: int, loader: DataLoader, max_steps: int | None = None, init_seed: int = 0) -> None:
    model = make_mlp(6, 3, hidden=8, dropout=0.1, seed=rank + init_seed)
    cfg = TrainingConfig(epochs=2, seed=3, output_dir=out, checkpoint_every=3, log_every=1, device="cpu",
                         max_steps=max_steps, num_workers=0)
    record: dict[str, Any] = {}
    try:
        result = Trainer(model, loader, cfg).fit()
        record.update(steps=result.steps, reason=str(result.reason), digest=digest(model))
    except Exception as exc:  # noqa: BLE001 - written for the test to assert on
        record.update(error=type(exc).__name__, message=str(exc))
    record["read"] = loader.dataset.read  # type: ignore[attr-defined]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    train(out / "sampler", rank, DataLoader(Recorded(), batch_size=5, sampler=ShuffledEvens()))
    train(out / "resumed", rank, DataLoader(Recorded(), batch_size=5, sampler=ShuffledEvens()), max_steps=3)
    train(out / "resumed", rank, DataLoader(Recorded(), batch_size=5, sampler=ShuffledEvens()), init_seed=100)
    train(out / "batches", rank, DataLoader(Recorded(), batch_sampler=ByLabel()))
    train(out / "sharded", rank, DataLoader(Recorded(), batch_size=5, sampler=OwnShard(rank, world)))
    train(out / "unseeded", rank, DataLoader(Recorded(), batch_size=5, sampler=Unseeded()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())

"""A DataLoader passed to the Trainer keeps the worker settings it was built with.

The engine rebuilds a passed loader over its own (resumable, rank-sharded) sampler; it kept the
dataset, batch size, collate_fn, num_workers and drop_last, and dropped the rest: a loader built
with ``multiprocessing_context="spawn"`` (for a dataset that is not fork-safe: threads, open
connections) was loaded by *forked* workers, and the user's ``worker_init_fn`` (opening a file or a
connection per worker) never ran.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from securetrain.training import Trainer, TrainingConfig
from securetrain.training.data import EpochFeeder


def _user_init(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.opened = f"opened-by-worker-{worker_id}"  # what a per-worker connection setup does


class _NeedsInit(Dataset):
    opened: str | None = None

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.opened is None:
            raise RuntimeError("worker_init_fn did not run in this worker")
        return torch.full((3,), float(index)), torch.tensor(index % 2)


def test_a_passed_loaders_worker_settings_are_kept() -> None:
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.zeros(16, dtype=torch.long)), batch_size=4,
                        num_workers=2, multiprocessing_context="spawn", timeout=30, prefetch_factor=3,
                        persistent_workers=True, worker_init_fn=_user_init)
    feeder = EpochFeeder(loader, batch_size=4, seed=0, shuffle=True, drop_last=False, num_workers=0, pin_memory=False)
    rebuilt = feeder.loader
    assert rebuilt is not loader and rebuilt.num_workers == 2
    assert rebuilt.multiprocessing_context is loader.multiprocessing_context
    assert rebuilt.multiprocessing_context.get_start_method() == "spawn"
    assert (rebuilt.timeout, rebuilt.prefetch_factor, rebuilt.persistent_workers) == (30, 3, True)
    assert rebuilt.worker_init_fn is not None and rebuilt.worker_init_fn is not _user_init  # chained after the engine's


def test_the_users_worker_init_fn_runs_in_every_worker(tmp_path: Path) -> None:
    seen: list[int] = []

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        seen.extend(x[:, 0].long().tolist())
        return torch.nn.functional.cross_entropy(model(x), y)

    loader = DataLoader(_NeedsInit(), batch_size=4, num_workers=2, worker_init_fn=_user_init,
                        multiprocessing_context="fork")
    cfg = TrainingConfig(epochs=1, output_dir=tmp_path, checkpoint_at_end=False, log_every=1)
    result = Trainer(torch.nn.Linear(3, 2), loader, cfg, loss_fn=loss).fit()
    assert result.reason == "completed" and sorted(seen) == list(range(16)), (os.getpid(), seen)

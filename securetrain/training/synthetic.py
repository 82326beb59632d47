"""A built-in synthetic classification task, so ``securetrain train`` works with no data at all."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class SyntheticClassification(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian blobs around random class centres: learnable, deterministic given ``seed``."""

    def __init__(self, samples: int = 2048, features: int = 32, classes: int = 4, *, seed: int = 0, noise: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, features, generator=g) * 2.0
        self.targets = torch.randint(0, classes, (samples,), generator=g)
        self.inputs = centres[self.targets] + noise * torch.randn(samples, features, generator=g)
        self.classes = classes

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


def make_mlp(features: int, classes: int, hidden: int = 64, *, dropout: float = 0.0, seed: int | None = None) -> nn.Module:
    """A small MLP; ``seed`` makes the initial weights reproducible without touching global RNG state."""
    fork = torch.random.fork_rng(devices=[]) if seed is not None else None
    if fork is not None:
        fork.__enter__()
        torch.manual_seed(seed)
    try:
        return nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
        )
    finally:
        if fork is not None:
            fork.__exit__(None, None, None)

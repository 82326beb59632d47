"""A language-model-shaped test model whose output projection is its embedding matrix (tied)."""

from __future__ import annotations

import torch
from torch import nn


class TiedNet(nn.Module):
    """``head.weight`` is ``embed.weight``; both are used through their modules' forward, as FSDP
    needs (a forward that reads another module's parameter directly fails under FSDP)."""

    def __init__(self, seed: int, in_features: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(3, 16)
            self.inp = nn.Linear(in_features, 16)
            self.drop = nn.Dropout(dropout)
            self.head = nn.Linear(16, 3, bias=False)
        self.head.weight = self.embed.weight  # the tie

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) + self.embed(torch.zeros(x.shape[0], dtype=torch.long, device=x.device))
        return self.head(self.drop(h))

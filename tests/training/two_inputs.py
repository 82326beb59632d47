"""A model whose forward takes two inputs (an image vector and clinical features), shared by tests."""

from __future__ import annotations

import torch
from torch import nn


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(6, 3)
        self.clinical = nn.Linear(2, 3)

    def forward(self, image: torch.Tensor, clinical: torch.Tensor) -> torch.Tensor:
        return self.image(image) + self.clinical(clinical)

"""The demo's model: a small CNN whose linear head can be evaluated under CKKS.

The convolutional trunk runs where the data is (the data owner computes features in plaintext);
the 2-class linear head becomes a binary logistic model ``w = W[1] - W[0]``, ``b = b[1] - b[0]``
(its logit is exactly the difference of the two class logits), which the evaluator applies to
*encrypted* features.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, hidden: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(1),  # "is there a bright blob anywhere": position-invariant
            nn.Flatten(),
            nn.Linear(2 * channels, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def logistic_head(model: SmallCNN) -> nn.Sequential:
    """The 2-class head as one logistic unit (logit of class 1 minus logit of class 0)."""
    if model.head.out_features != 2:
        raise ValueError("the HE head export needs a 2-class model")
    weight = model.head.weight.detach()
    bias = model.head.bias.detach()
    linear = nn.Linear(model.head.in_features, 1)
    with torch.no_grad():
        linear.weight.copy_((weight[1] - weight[0]).unsqueeze(0))
        linear.bias.copy_((bias[1] - bias[0]).unsqueeze(0))
    return nn.Sequential(linear)

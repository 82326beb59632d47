"""An example of a user's own model, named in ``examples/byom.yaml`` as ``user_nets:build``.

The pipeline imports this module from the config file's folder (then PYTHONPATH), calls
``build(**model.kwargs)`` and adds ``num_classes`` and ``in_channels`` because ``build`` accepts
them. Any ``nn.Module`` returning ``[batch, num_classes]`` logits works; the last ``nn.Linear`` is
the head that HE evaluation scores on encrypted features.
"""

from __future__ import annotations

from torch import nn


class SmallResNet(nn.Module):
    """Two residual conv blocks with batch norm, global average pooling and a linear classifier."""

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = self._block(width)
        self.block2 = self._block(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(width, num_classes)

    @staticmethod
    def _block(width: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
        )

    def forward(self, x):  # noqa: ANN001, ANN201
        x = self.stem(x)
        x = (x + self.block1(x)).relu()
        x = (x + self.block2(x)).relu()
        return self.classifier(self.pool(x).flatten(1))


def build(num_classes: int, in_channels: int = 1, width: int = 16) -> nn.Module:
    return SmallResNet(num_classes, in_channels, width)

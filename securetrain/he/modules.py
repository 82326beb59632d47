"""HE-friendly activations as torch modules, so a model can be *trained* with the exact
polynomial it will be evaluated with under encryption (no approximation error at all)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class PolyActivation(nn.Module):
    """p(x) = Σ coeffs[i]·x^i (lowest degree first); coefficients are fixed, not trained."""

    def __init__(self, coeffs: Sequence[float]) -> None:
        super().__init__()
        if len(coeffs) < 2:
            raise ValueError("PolyActivation needs at least degree 1")
        self.coeffs = tuple(float(c) for c in coeffs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(x, self.coeffs[-1])
        for c in reversed(self.coeffs[:-1]):  # Horner
            out = out * x + c
        return out

    def extra_repr(self) -> str:
        return f"coeffs={list(self.coeffs)}"


class Square(PolyActivation):
    """x², the classic CryptoNets activation (depth 1)."""

    def __init__(self) -> None:
        super().__init__((0.0, 0.0, 1.0))

    def extra_repr(self) -> str:
        return ""

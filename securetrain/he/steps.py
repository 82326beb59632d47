"""The steps of an HE plan (affine layers and polynomial activations): a leaf module, so that
``plan`` (compilation) and ``strategy`` (evaluation) can both use them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinearStep:
    weight: np.ndarray  # (out, in) float64
    bias: np.ndarray  # (out,) float64

    @property
    def n_in(self) -> int:
        return int(self.weight.shape[1])

    @property
    def n_out(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class PolyStep:
    coeffs: tuple[float, ...]  # power basis, lowest degree first
    source: str  # "poly" (exact, from the model) or the activation it approximates
    input_range: float | None = None
    max_abs_error: float | None = None  # of the approximation on [-R, R]

    @property
    def degree(self) -> int:
        return len(self.coeffs) - 1


Step = LinearStep | PolyStep

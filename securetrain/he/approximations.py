"""Least-squares polynomial approximations of activations on a stated input range [-R, R].

CKKS evaluates only additions and multiplications, so every non-polynomial activation is
replaced by a low-degree polynomial fitted (numpy least squares on a dense uniform grid) on
[-R, R]. Outside that range the polynomial diverges quickly: R must cover the pre-activation
values the model actually sees (:func:`securetrain.he.evaluate.evaluate_encrypted` reports the
fraction that fall outside). Defaults below are documented in docs/homomorphic-evaluation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from securetrain.he.errors import HEModelError


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import erf

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0),
    "silu": lambda x: x * _sigmoid(x),
    "gelu": _gelu,
    "softplus": lambda x: np.logaddexp(0.0, x),
}

#: (degree, R) used when the caller does not say. Degree 3 costs the same depth as degree 2 in
#: our evaluation strategy (see strategy.py), so odd functions get 3.
DEFAULT_APPROX: dict[str, tuple[int, float]] = {
    "sigmoid": (3, 8.0),
    "tanh": (3, 3.0),
    "relu": (2, 4.0),
    "silu": (2, 4.0),
    "gelu": (2, 4.0),
    "softplus": (2, 4.0),
}

_GRID_POINTS = 4001


@dataclass(frozen=True)
class PolyApprox:
    """``coeffs`` are in the power basis, lowest degree first: p(x) = Σ coeffs[i]·x^i."""

    activation: str
    degree: int
    input_range: float
    coeffs: tuple[float, ...]
    max_abs_error: float
    rms_error: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.polynomial.polynomial.polyval(x, np.asarray(self.coeffs))


def fit_activation(activation: str, degree: int | None = None, input_range: float | None = None) -> PolyApprox:
    """Fit ``activation`` (a name from :data:`ACTIVATIONS`) by a degree-``degree`` polynomial on
    [-input_range, input_range]."""
    name = activation.lower()
    if name not in ACTIVATIONS:
        raise HEModelError(
            f"no polynomial approximation for activation {activation!r}",
            hint=f"supported: {sorted(ACTIVATIONS)}, or use securetrain.he.PolyActivation / Square",
        )
    d_default, r_default = DEFAULT_APPROX[name]
    d = d_default if degree is None else int(degree)
    r = r_default if input_range is None else float(input_range)
    if not 1 <= d <= 8:
        raise HEModelError(f"approximation degree must be in 1..8, got {d}")
    if not (math.isfinite(r) and r > 0):
        raise HEModelError(f"approximation range R must be a positive number, got {r}")
    x = np.linspace(-r, r, _GRID_POINTS)
    y = ACTIVATIONS[name](x)
    # Fit in the scaled variable t = x/R (well conditioned), then convert to the power basis in x.
    t_coeffs = np.polynomial.polynomial.polyfit(x / r, y, d)
    coeffs = t_coeffs / r ** np.arange(d + 1)
    # Odd/even symmetry leaves ~1e-17 coefficients; exact zeros save multiplications.
    scale = np.max(np.abs(coeffs))
    coeffs = np.where(np.abs(coeffs) < 1e-12 * scale, 0.0, coeffs)
    err = np.polynomial.polynomial.polyval(x, coeffs) - y
    return PolyApprox(
        activation=name,
        degree=d,
        input_range=r,
        coeffs=tuple(float(c) for c in coeffs),
        max_abs_error=float(np.max(np.abs(err))),
        rms_error=float(np.sqrt(np.mean(err**2))),
    )

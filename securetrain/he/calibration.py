"""The data owner's plaintext calibration pass: how large the model's values really get.

Run on the data owner's side (it needs plaintext features) through the *same* strategy code as the
encrypted evaluation, so it sees every intermediate value CKKS will hold:

* ``value_abs_max`` — the largest |value| of any node. The overflow check and
  :func:`~securetrain.he.params.choose_params` use ``value_bound`` (a power of two ≥ ``margin`` ×
  that) instead of the worst case of interval arithmetic, which explodes with depth (a 64-32-16-10
  MLP peaking at 142 got a worst-case bound of 5.5e5).
* per approximated activation: the largest |pre-activation| and the fraction outside the fitted
  interval [-R, R], where the polynomial diverges.

The evaluator learns only ``value_bound`` (a power of two), like ``input_abs_max``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from securetrain.he.errors import HEModelError
from securetrain.he.plan import HEPlan, PolyStep
from securetrain.he.strategy import Node, NumpyBackend, Ops, run_plan

DEFAULT_MARGIN = 2.0


def pow2_ceil(value: float) -> float:
    """Smallest power of two ≥ value (1.0 for value ≤ 0)."""
    return float(2.0 ** math.ceil(math.log2(value))) if value > 0 else 1.0


@dataclass(frozen=True)
class Calibration:
    n_samples: int
    value_abs_max: float
    value_bound: float
    preactivation_abs_max: tuple[float, ...]  # per approximated PolyStep, in plan order
    out_of_interval: tuple[float, ...]  # fraction of pre-activations outside [-R, R], same order

    @property
    def out_of_interval_fraction(self) -> float:
        """The worst approximated activation's fraction (0.0 when nothing is approximated)."""
        return max(self.out_of_interval, default=0.0)


def approximated_steps(plan: HEPlan) -> list[int]:
    return [i for i, s in enumerate(plan.steps) if isinstance(s, PolyStep) and s.input_range is not None]


def poly_step(plan: HEPlan, index: int) -> PolyStep:
    """Step ``index`` of ``plan`` as the :class:`PolyStep` that :func:`approximated_steps` listed."""
    step = plan.steps[index]
    if not isinstance(step, PolyStep):
        raise TypeError(f"plan step {index} is a {type(step).__name__}, not a polynomial")
    return step


def calibrate(plan: HEPlan, features: np.ndarray, *, margin: float = DEFAULT_MARGIN) -> Calibration:
    """Plaintext pass of ``plan`` on ``features`` (n_samples, n_inputs)."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != plan.n_inputs or len(x) == 0:
        raise HEModelError(f"calibration features must have shape (n>0, {plan.n_inputs}), got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise HEModelError("calibration features contain NaN or inf")
    worst = float(np.max(np.abs(x)))

    def visit(node: Node) -> None:
        nonlocal worst
        worst = max(worst, float(np.max(np.abs(node.payload))))

    run_plan(plan, [Node(x[:, j].copy(), 0) for j in range(plan.n_inputs)], Ops(NumpyBackend(), on_node=visit))
    pre_max: list[float] = []
    outside: list[float] = []
    h = x
    for s in plan.steps:  # the values entering each polynomial, step by step
        if isinstance(s, PolyStep):
            if s.input_range is not None:
                pre_max.append(float(np.max(np.abs(h))))
                outside.append(float(np.mean(np.abs(h) > s.input_range)))
            h = np.polynomial.polynomial.polyval(h, np.asarray(s.coeffs))
        else:
            h = h @ s.weight.T + s.bias
    if not math.isfinite(worst):
        raise HEModelError("the model produces non-finite values on the calibration set",
                           hint="standardise the features or use smaller approximation ranges")
    return Calibration(len(x), worst, pow2_ceil(margin * worst), tuple(pre_max), tuple(outside))


def packed_abs_max(plan: HEPlan, features: np.ndarray, blocks: int) -> float:
    """Largest |value| the feature-packed evaluation of a one-affine-step plan holds: each block
    carries a *partial* sum over its features (which can exceed the full sum), and every product."""
    from securetrain.he.plan import LinearStep

    step = plan.steps[0]
    if len(plan.steps) != 1 or not isinstance(step, LinearStep):
        raise HEModelError("packing applies to a single affine step only")
    x = np.asarray(features, dtype=np.float64)
    worst = 0.0
    for g in range(math.ceil(plan.n_inputs / blocks)):
        for i in range(blocks):
            j = g * blocks + i
            if j >= plan.n_inputs:
                break
            worst = max(worst, float(np.max(np.abs(np.outer(x[:, j], step.weight[:, j])))))
    for i in range(blocks):  # block i of every output sums features g·blocks+i over g
        cols = list(range(i, plan.n_inputs, blocks))
        partial = x[:, cols] @ step.weight[:, cols].T + (step.bias if i == 0 else 0.0)
        worst = max(worst, float(np.max(np.abs(partial))))
    return worst

"""The one evaluation strategy, run on interchangeable arithmetic backends.

The same code computes the encrypted result (TenSEAL), the plaintext reference (numpy, so the
HE error measures only CKKS noise), the multiplicative depth, and interval bounds for the
overflow check — they cannot disagree about what is computed.

Layout is feature-major: one ciphertext per feature (or hidden unit) whose slots are samples, so
every operation is slot-wise and no rotation is ever needed.

Depth (one level = one rescale, consumed by every multiplication, plaintext or ciphertext):

* affine step  y_k = Σ_j w_kj·x_j + b_k                    → +1
* polynomial p of degree d followed by an affine step, fused:
  y_k = Σ_j Σ_i (w_kj·a_i)·h_j^i + (b_k + a_0·Σ_j w_kj)      → +⌈log2(d+1)⌉
  each term c·h^i is built as (c·h^r)·h^(2^m) with 2^m the largest power of two below i
  (c·h^(2^m) when i is a power of two); powers h^(2^m) are shared across outputs. Degree 2 and 3
  cost 2 levels, degree 4..7 cost 3.
* a trailing polynomial is fused with the identity affine step (same cost).

TenSEAL resets a ciphertext's scale to Δ after each rescale although the true scale is Δ²/q; a
node therefore carries ``factor`` (decrypted value = factor × intended value) and every plaintext
coefficient is pre-multiplied so results come out with factor 1 (see params.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from securetrain.he.steps import LinearStep, PolyStep

if TYPE_CHECKING:
    from securetrain.he.plan import HEPlan


@dataclass
class Node:
    payload: Any
    level: int
    factor: float = 1.0


class RawBackend(Protocol):
    # c: a scalar, or (packed evaluation on TenSEAL) one plain value per slot
    def mul_plain(self, x: Any, c: Any) -> Any: ...
    def mul(self, x: Any, y: Any) -> Any: ...
    def add(self, x: Any, y: Any) -> Any: ...
    def add_plain(self, x: Any, c: Any) -> Any: ...


class Ops:
    """Level/factor bookkeeping on top of a raw backend."""

    def __init__(
        self,
        backend: RawBackend,
        rescale_ratio: Callable[[int], float] | None = None,
        on_node: Callable[[Node], None] | None = None,
        threads: int = 1,
    ) -> None:
        self.b = backend
        self.ratio = rescale_ratio or (lambda level: 1.0)
        self.on_node = on_node
        self.threads = max(1, threads)

    def _emit(self, node: Node) -> Node:
        if self.on_node is not None:
            self.on_node(node)
        return node

    def mul_plain(self, x: Node, c: float | np.ndarray, out_factor: float = 1.0) -> Node:
        k = c * out_factor / (x.factor * self.ratio(x.level))
        return self._emit(Node(self.b.mul_plain(x.payload, k), x.level + 1, out_factor))

    def mul(self, x: Node, y: Node) -> Node:
        level = max(x.level, y.level)  # the higher one is mod-switched down first
        return self._emit(Node(self.b.mul(x.payload, y.payload), level + 1, x.factor * y.factor * self.ratio(level)))

    def add(self, x: Node, y: Node) -> Node:
        if not math.isclose(x.factor, y.factor, rel_tol=1e-12):
            raise AssertionError(f"internal: adding nodes with factors {x.factor} and {y.factor}")
        return self._emit(Node(self.b.add(x.payload, y.payload), max(x.level, y.level), x.factor))

    def add_plain(self, x: Node, c: float | np.ndarray) -> Node:
        return self._emit(Node(self.b.add_plain(x.payload, c * x.factor), x.level, x.factor))

    def total(self, nodes: Sequence[Node]) -> Node:
        acc = nodes[0]
        for n in nodes[1:]:
            acc = self.add(acc, n)
        return acc

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        items = list(items)
        if self.threads == 1 or len(items) < 2:
            return [fn(i) for i in items]
        # TenSEAL releases the GIL inside its C++ operations, so threads scale.
        with ThreadPoolExecutor(max_workers=min(self.threads, len(items))) as pool:
            return list(pool.map(fn, items))


# --- the strategy -------------------------------------------------------------------------------


def _linear(ops: Ops, xs: Sequence[Node], step: LinearStep) -> list[Node]:
    chunks = max(1, min(ops.threads // max(1, step.n_out), len(xs)))
    bounds = np.linspace(0, len(xs), chunks + 1).astype(int)

    def partial(job: tuple[int, int]) -> Node | None:
        k, c = job
        terms = [ops.mul_plain(xs[j], float(step.weight[k, j])) for j in range(bounds[c], bounds[c + 1])
                 if step.weight[k, j] != 0.0]
        return ops.total(terms) if terms else None

    parts = ops.map(partial, [(k, c) for k in range(step.n_out) for c in range(chunks)])
    out = []
    for k in range(step.n_out):
        mine = [p for p in parts[k * chunks:(k + 1) * chunks] if p is not None]
        acc = ops.total(mine) if mine else ops.mul_plain(xs[0], 0.0)  # an all-zero row
        out.append(ops.add_plain(acc, float(step.bias[k])))
    return out


def _powers(ops: Ops, h: Node, degree: int) -> dict[int, Node]:
    """h^(2^m) for every 2^m ≤ degree, by repeated squaring."""
    powers = {1: h}
    p = 1
    while 2 * p <= degree:
        powers[2 * p] = ops.mul(powers[p], powers[p])
        p *= 2
    return powers


def _term_level(i: int, powers: dict[int, Node]) -> int:
    if i & (i - 1) == 0:
        return powers[i].level + 1
    m = 1 << (i.bit_length() - 1)
    return max(_term_level(i - m, powers), powers[m].level) + 1


def _term(ops: Ops, c: float, i: int, powers: dict[int, Node], target: float = 1.0) -> Node:
    """A node whose decrypted value is target × c·h^i."""
    if i & (i - 1) == 0:
        return ops.mul_plain(powers[i], c, out_factor=target)
    m = 1 << (i.bit_length() - 1)
    level = max(_term_level(i - m, powers), powers[m].level)
    left = _term(ops, c, i - m, powers, target / (powers[m].factor * ops.ratio(level)))
    return ops.mul(left, powers[m])


def _poly_linear(ops: Ops, hs: Sequence[Node], poly: PolyStep, step: LinearStep) -> list[Node]:
    a = poly.coeffs
    powers = ops.map(lambda h: _powers(ops, h, poly.degree), hs)

    def output(k: int) -> Node:
        terms = [
            _term(ops, float(step.weight[k, j]) * a[i], i, powers[j])
            for j in range(len(hs)) if step.weight[k, j] != 0.0
            for i in range(1, len(a)) if a[i] != 0.0
        ]
        const = float(step.bias[k]) + a[0] * float(np.sum(step.weight[k]))
        acc = ops.total(terms) if terms else ops.mul_plain(hs[0], 0.0)
        return ops.add_plain(acc, const)

    return ops.map(output, range(step.n_out))


def run_plan(plan: HEPlan, inputs: Sequence[Node], ops: Ops) -> list[Node]:
    if len(inputs) != plan.n_inputs:
        raise ValueError(f"plan expects {plan.n_inputs} input columns, got {len(inputs)}")
    nodes = list(inputs)
    steps = list(plan.steps)
    i = 0
    while i < len(steps):
        s = steps[i]
        if isinstance(s, PolyStep):
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            if isinstance(nxt, LinearStep):
                nodes = _poly_linear(ops, nodes, s, nxt)
                i += 2
                continue
            n = len(nodes)
            nodes = _poly_linear(ops, nodes, s, LinearStep(np.eye(n), np.zeros(n)))
        else:
            nodes = _linear(ops, nodes, s)
        i += 1
    return nodes


# --- backends -----------------------------------------------------------------------------------


class NumpyBackend:
    def mul_plain(self, x: np.ndarray, c: float) -> np.ndarray:
        return x * c

    def mul(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x * y

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x + y

    def add_plain(self, x: np.ndarray, c: float) -> np.ndarray:
        return x + c


class NullBackend:
    def mul_plain(self, x: None, c: float) -> None:
        return None

    def mul(self, x: None, y: None) -> None:
        return None

    def add(self, x: None, y: None) -> None:
        return None

    def add_plain(self, x: None, c: float) -> None:
        return None


class IntervalBackend:
    """Payload (lo, hi): a sound enclosure of every slot's value, for the overflow check."""

    def mul_plain(self, x: tuple[float, float], c: float) -> tuple[float, float]:
        a, b = x[0] * c, x[1] * c
        return (min(a, b), max(a, b))

    def mul(self, x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
        if x is y:  # squaring: the enclosure of x² is tighter than x·y
            lo, hi = x
            sq = (lo * lo, hi * hi)
            return (0.0 if lo <= 0.0 <= hi else min(sq), max(sq))
        p = (x[0] * y[0], x[0] * y[1], x[1] * y[0], x[1] * y[1])
        return (min(p), max(p))

    def add(self, x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
        return (x[0] + y[0], x[1] + y[1])

    def add_plain(self, x: tuple[float, float], c: float) -> tuple[float, float]:
        return (x[0] + c, x[1] + c)


def evaluate_numpy(plan: HEPlan, features: np.ndarray) -> np.ndarray:
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != plan.n_inputs:
        raise ValueError(f"expected features of shape (n, {plan.n_inputs}), got {x.shape}")
    out = run_plan(plan, [Node(x[:, j].copy(), 0) for j in range(plan.n_inputs)], Ops(NumpyBackend()))
    return np.stack([n.payload for n in out], axis=1)


def plan_depth(plan: HEPlan) -> int:
    out = run_plan(plan, [Node(None, 0) for _ in range(plan.n_inputs)], Ops(NullBackend()))
    return max(n.level for n in out)


def max_abs_bound(plan: HEPlan, input_abs_max: float, check: Callable[[Node], None] | None = None) -> float:
    """Largest |value| any node can take when every input lies in [-input_abs_max, input_abs_max]."""
    worst = 0.0

    def visit(node: Node) -> None:
        nonlocal worst
        worst = max(worst, abs(node.payload[0]), abs(node.payload[1]))
        if check is not None:
            check(node)

    box = (-float(input_abs_max), float(input_abs_max))
    run_plan(plan, [Node(box, 0) for _ in range(plan.n_inputs)], Ops(IntervalBackend(), on_node=visit))
    return worst

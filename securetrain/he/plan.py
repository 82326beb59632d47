"""Turn a PyTorch model into an HE evaluation plan: affine maps and polynomials only.

Supported: ``nn.Sequential`` (nested ones are flattened) of ``nn.Linear``, ``nn.Identity``,
``nn.Dropout`` (a no-op at evaluation), the activations in
:data:`securetrain.he.approximations.ACTIVATIONS` (replaced by fitted polynomials) and
:class:`~securetrain.he.modules.PolyActivation` / :class:`~securetrain.he.modules.Square` (exact).

Normalisation saves depth: consecutive affine steps are multiplied out into one, and a degree-1
polynomial is folded into the neighbouring affine step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from securetrain.he.approximations import PolyApprox, fit_activation
from securetrain.he.errors import HEModelError

OutputKind = Literal["logits", "probabilities"]
PLAN_FORMAT = "securetrain.he.plan/1"


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


@dataclass(frozen=True)
class HEPlan:
    steps: tuple[Step, ...]
    n_inputs: int
    n_outputs: int
    output: OutputKind = "logits"
    approximations: tuple[PolyApprox, ...] = field(default=())

    @property
    def depth(self) -> int:
        """Multiplicative depth of our evaluation strategy (see strategy.plan_depth)."""
        from securetrain.he.strategy import plan_depth

        return plan_depth(self)

    def to_dict(self) -> dict[str, Any]:
        steps: list[dict[str, Any]] = []
        for s in self.steps:
            if isinstance(s, LinearStep):
                steps.append({"type": "linear", "weight": s.weight.tolist(), "bias": s.bias.tolist()})
            else:
                steps.append(
                    {
                        "type": "poly",
                        "coeffs": list(s.coeffs),
                        "source": s.source,
                        "input_range": s.input_range,
                        "max_abs_error": s.max_abs_error,
                    }
                )
        return {
            "format": PLAN_FORMAT,
            "n_inputs": self.n_inputs,
            "n_outputs": self.n_outputs,
            "output": self.output,
            "steps": steps,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HEPlan:
        try:
            if data.get("format") != PLAN_FORMAT:
                raise HEModelError(f"not an HE plan (format {data.get('format')!r}, expected {PLAN_FORMAT!r})")
            steps: list[Step] = []
            for raw in data["steps"]:
                if raw["type"] == "linear":
                    steps.append(LinearStep(np.asarray(raw["weight"], float), np.asarray(raw["bias"], float)))
                elif raw["type"] == "poly":
                    steps.append(
                        PolyStep(tuple(float(c) for c in raw["coeffs"]), str(raw["source"]),
                                 raw.get("input_range"), raw.get("max_abs_error"))
                    )
                else:
                    raise HEModelError(f"unknown plan step type {raw['type']!r}")
            plan = cls(tuple(steps), int(data["n_inputs"]), int(data["n_outputs"]), data["output"])
        except (KeyError, TypeError, ValueError) as exc:
            raise HEModelError(f"malformed HE plan: {exc}") from exc
        _check_shapes(plan.steps, plan.n_inputs)
        return plan

    def sha256(self) -> str:
        """Digest of the canonical JSON (RFC 8785) form: what the audit log calls the model."""
        import rfc8785

        return hashlib.sha256(rfc8785.dumps(self.to_dict())).hexdigest()

    def evaluate_plain(self, features: np.ndarray) -> np.ndarray:
        """(n_samples, n_inputs) → (n_samples, n_outputs), in float64 with *exactly* the
        operations the encrypted evaluation performs: the reference for the HE error."""
        from securetrain.he.strategy import evaluate_numpy

        return evaluate_numpy(self, features)


def _check_shapes(steps: tuple[Step, ...], n_inputs: int) -> int:
    width = n_inputs
    for s in steps:
        if isinstance(s, LinearStep):
            if s.weight.ndim != 2 or s.bias.shape != (s.n_out,) or s.n_in != width:
                raise HEModelError(f"linear step expects {s.n_in} inputs, gets {width}")
            if not (np.all(np.isfinite(s.weight)) and np.all(np.isfinite(s.bias))):
                raise HEModelError("model weights contain NaN/inf")
            width = s.n_out
        else:
            if s.degree < 1 or not all(math.isfinite(c) for c in s.coeffs):
                raise HEModelError(f"polynomial step needs degree ≥ 1 and finite coefficients: {s.coeffs}")
    return width


# --- normalisation ------------------------------------------------------------------------------


def _trim(coeffs: tuple[float, ...]) -> tuple[float, ...]:
    c = list(coeffs)
    while len(c) > 1 and c[-1] == 0.0:
        c.pop()
    return tuple(c)


def normalise(steps: list[Step]) -> list[Step]:
    """Fold degree-1 polynomials into affine steps and multiply out consecutive affine steps."""
    out: list[Step] = []
    for s in steps:
        if isinstance(s, PolyStep):
            s = PolyStep(_trim(s.coeffs), s.source, s.input_range, s.max_abs_error)
            if s.degree == 0:
                raise HEModelError("an activation collapsed to a constant: the model output would not depend on the input")
            if s.degree == 1:
                a0, a1 = s.coeffs
                if out and isinstance(out[-1], LinearStep):
                    prev = out.pop()
                    s = LinearStep(a1 * prev.weight, a1 * prev.bias + a0)
                else:
                    out.append(s)  # affine on the raw input: evaluated as a degree-1 poly
                    continue
        if isinstance(s, LinearStep) and out and isinstance(out[-1], LinearStep):
            prev = out.pop()
            s = LinearStep(s.weight @ prev.weight, s.weight @ prev.bias + s.bias)
        out.append(s)
    return out


# --- from torch ---------------------------------------------------------------------------------


def _flatten_modules(model: Any) -> list[Any]:
    from torch import nn

    if isinstance(model, nn.Sequential):
        mods: list[Any] = []
        for m in model:
            mods.extend(_flatten_modules(m))
        return mods
    return [model]


def compile_plan(
    model: Any,
    *,
    output: OutputKind = "logits",
    approximations: Mapping[str, tuple[int | None, float | None]] | None = None,
    n_inputs: int | None = None,
) -> HEPlan:
    """Convert ``model`` (an ``nn.Sequential``, or a single ``nn.Linear``) into an :class:`HEPlan`.

    ``output="logits"`` drops a trailing ``nn.Sigmoid`` (depth stays minimal; AUC and the 0/0.5
    threshold are unchanged); ``"probabilities"`` keeps it (or appends one) as a fitted polynomial.
    ``approximations`` overrides ``{activation_name: (degree, R)}`` (see approximations.py).
    """
    from torch import nn

    from securetrain.he.modules import PolyActivation

    if output not in ("logits", "probabilities"):
        raise HEModelError(f"output must be 'logits' or 'probabilities', got {output!r}")
    approx_cfg = {k.lower(): v for k, v in (approximations or {}).items()}
    modules = [m for m in _flatten_modules(model) if not isinstance(m, nn.Identity | nn.Dropout)]
    if modules and isinstance(modules[-1], nn.Sigmoid):
        modules = modules[:-1]
    if output == "probabilities":
        modules.append(nn.Sigmoid())

    fits: list[PolyApprox] = []
    steps: list[Step] = []
    for m in modules:
        if isinstance(m, nn.Linear):
            w = m.weight.detach().double().cpu().numpy().copy()
            b = (m.bias.detach().double().cpu().numpy().copy() if m.bias is not None else np.zeros(w.shape[0]))
            steps.append(LinearStep(w, b))
        elif isinstance(m, PolyActivation):
            steps.append(PolyStep(m.coeffs, "poly"))
        else:
            name = type(m).__name__.lower()
            degree, r = approx_cfg.get(name, (None, None))
            fit = fit_activation(name, degree, r)  # raises HEModelError for unknown modules
            fits.append(fit)
            steps.append(PolyStep(fit.coeffs, fit.activation, fit.input_range, fit.max_abs_error))
    if not steps:
        raise HEModelError("the model has no layers")
    first_linear = next((s for s in steps if isinstance(s, LinearStep)), None)
    width_in = n_inputs if n_inputs is not None else (first_linear.n_in if first_linear is not None else None)
    if width_in is None:
        raise HEModelError("cannot infer the number of inputs; pass n_inputs")
    _check_shapes(tuple(steps), width_in)  # before fusing, so errors name the model's own shapes
    steps = normalise(steps)
    n_out = _check_shapes(tuple(steps), width_in)
    return HEPlan(tuple(steps), width_in, n_out, output, tuple(fits))


def reference_forward(model: Any, features: np.ndarray, output: OutputKind) -> np.ndarray:
    """The *exact* model (true activations) with the same output semantics as the plan."""
    import copy

    import torch
    from torch import nn

    model = copy.deepcopy(model).double()  # never mutate the caller's model
    modules = [m for m in _flatten_modules(model) if not isinstance(m, nn.Identity | nn.Dropout)]
    if modules and isinstance(modules[-1], nn.Sigmoid):
        modules = modules[:-1]
    if output == "probabilities":
        modules.append(nn.Sigmoid())
    x = torch.as_tensor(np.asarray(features, dtype=np.float64))
    with torch.no_grad():
        for m in modules:
            x = m(x)
    return x.numpy().reshape(len(features), -1)

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
from typing import Any, Literal, cast

import numpy as np

from securetrain.he.approximations import PolyApprox, fit_activation
from securetrain.he.errors import HEModelError
from securetrain.he.steps import LinearStep, PolyStep, Step
from securetrain.he.strategy import evaluate_numpy, plan_depth

OutputKind = Literal["logits", "probabilities"]
PLAN_FORMAT = "securetrain.he.plan/1"




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
                    prev = cast(LinearStep, out.pop())  # checked on the line above
                    s = LinearStep(a1 * prev.weight, a1 * prev.bias + a0)
                else:
                    out.append(s)  # affine on the raw input: evaluated as a degree-1 poly
                    continue
        if isinstance(s, LinearStep) and out and isinstance(out[-1], LinearStep):
            prev = cast(LinearStep, out.pop())
            s = LinearStep(s.weight @ prev.weight, s.weight @ prev.bias + s.bias)
        out.append(s)
    return out


# --- from torch ---------------------------------------------------------------------------------


def _approx_for(layer: Any, approx_cfg: Mapping[str, tuple[int | None, float | None]]) -> tuple[int | None, float | None]:
    """A layer path entry wins over an activation-name entry; missing parts stay default."""
    by_path = approx_cfg.get(layer.path)
    by_name = approx_cfg.get(str(layer.activation))
    degree = next((v[0] for v in (by_path, by_name) if v is not None and v[0] is not None), None)
    r = next((v[1] for v in (by_path, by_name) if v is not None and v[1] is not None), None)
    return degree, r


def compile_model(
    model: Any,
    *,
    output: OutputKind = "logits",
    approximations: Mapping[str, tuple[int | None, float | None]] | None = None,
    n_inputs: int | None = None,
) -> tuple[HEPlan, str | None, list[str]]:
    """(plan, the model's final activation or None, the paths of approximated layers in plan order)."""
    from securetrain.he.layers import split_final, trace_layers, unsupported

    if output not in ("logits", "probabilities"):
        raise HEModelError(f"output must be 'logits' or 'probabilities', got {output!r}")
    approx_cfg = {k if "." in k or k not in _ACT_NAMES else k.lower(): v for k, v in (approximations or {}).items()}
    approx_cfg |= {k.lower(): v for k, v in (approximations or {}).items() if k.lower() in _ACT_NAMES}
    body, final = split_final(trace_layers(model))

    fits: list[PolyApprox] = []
    paths: list[str] = []
    steps: list[Step] = []
    owners: list[Any] = []  # the layer each step comes from (None: the appended output sigmoid)
    for layer in body:
        _check_materialised(layer)
        owners.append(layer)
        if layer.kind == "noop":
            owners.pop()
        if layer.kind == "linear":
            m = layer.module
            w = m.weight.detach().double().cpu().numpy().copy()
            b = (m.bias.detach().double().cpu().numpy().copy() if m.bias is not None else np.zeros(w.shape[0]))
            steps.append(LinearStep(w, b))
        elif layer.kind == "batchnorm":
            steps.append(_batchnorm_step(layer.module))
        elif layer.kind == "poly":
            steps.append(PolyStep(layer.module.coeffs, "poly"))
        elif layer.kind == "activation":
            degree, r = _approx_for(layer, approx_cfg)
            fit = fit_activation(str(layer.activation), degree, r)
            fits.append(fit)
            paths.append(layer.path)
            steps.append(PolyStep(fit.coeffs, fit.activation, fit.input_range, fit.max_abs_error))
        elif layer.kind != "noop":  # pragma: no cover - split_final handles "final"
            raise unsupported(layer.path, layer.type_name)
    if output == "probabilities":
        if final not in (None, "sigmoid"):
            raise HEModelError(
                f"the model ends in {final}: it has no polynomial form under encryption",
                hint="apply it at the data owner after decryption (evaluate_encrypted(..., output='probabilities') "
                     "does this by default)",
            )
        degree, r = approx_cfg.get("sigmoid", (None, None))
        fit = fit_activation("sigmoid", degree, r)
        fits.append(fit)
        paths.append("<output sigmoid>")
        steps.append(PolyStep(fit.coeffs, fit.activation, fit.input_range, fit.max_abs_error))
        owners.append(None)
    if not steps:
        raise HEModelError("the model has no layers to evaluate")
    first_linear = next((s for s in steps if isinstance(s, LinearStep)), None)
    width_in = n_inputs if n_inputs is not None else (first_linear.n_in if first_linear is not None else None)
    if width_in is None:
        raise HEModelError("cannot infer the number of inputs; pass n_inputs")
    _check_layer_shapes(steps, owners, width_in)  # before fusing, so errors name the model's own layers
    _check_shapes(tuple(steps), width_in)
    steps = normalise(steps)
    n_out = _check_shapes(tuple(steps), width_in)
    if output == "probabilities" and n_out != 1:
        raise HEModelError(f"an encrypted sigmoid needs one output, the model has {n_out}",
                           hint="use probabilities at the data owner (the default of evaluate_encrypted)")
    return HEPlan(tuple(steps), width_in, n_out, output, tuple(fits)), final, paths


_ACT_NAMES = ("relu", "sigmoid", "tanh", "silu", "gelu", "softplus")


def _check_materialised(layer: Any) -> None:
    """Refuse a layer whose parameters/buffers live on the meta device (shapes only, no values), or
    are still uninitialised (a lazy module, e.g. LazyLinear, that never saw a batch)."""
    from torch.nn.parameter import is_lazy

    m = layer.module
    if m is None:
        return
    tensors = list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
    for name, t in tensors:
        if t is not None and is_lazy(t):
            raise HEModelError(
                f"layer {layer.describe()} has its {name!r} uninitialised (a lazy module): it holds no values to "
                "evaluate",
                hint="run the model once on a dummy batch (or load the trained weights) so the lazy layer gets its "
                     "shape and values",
            )
        if t is not None and getattr(t, "is_meta", False):
            raise HEModelError(
                f"layer {layer.describe()} has its {name!r} on the meta device: it holds no values to evaluate",
                hint="materialise and load the trained weights first (model.to_empty(device='cpu'); "
                     "model.load_state_dict(...)); models on CPU or GPU are read as they are",
            )


def _check_layer_shapes(steps: list[Step], owners: list[Any], width_in: int) -> None:
    """Each affine step must take the previous step's width; a mismatch names both layers."""
    width, prev = width_in, None
    for s, layer in zip(steps, owners, strict=True):
        if not isinstance(s, LinearStep):
            continue
        if s.n_in != width:
            here = layer.describe() if layer is not None else "the output"
            before = f"layer {prev.describe()} gives {width}" if prev is not None else f"the input has {width}"
            bn = any(x is not None and x.kind == "batchnorm" for x in (layer, prev))
            raise HEModelError(
                f"layer {here} expects {s.n_in} features per sample, but {before}",
                hint=("BatchNorm1d is evaluated on (N, features) inputs only; over the channels of an (N, C, L) "
                      "input it is not a per-feature map: flatten before it, or run it on the data owner's side "
                      "(securetrain.he.split_for_he)") if bn else
                     "the layers do not chain: check the model's shapes (and n_inputs)",
            )
        width, prev = s.n_out, layer


def _batchnorm_step(bn: Any) -> LinearStep:
    """BatchNorm1d at evaluation: y = (x − mean)/√(var+eps)·γ + β, a diagonal affine map."""
    mean = bn.running_mean.detach().double().cpu().numpy()
    var = bn.running_var.detach().double().cpu().numpy()
    scale = 1.0 / np.sqrt(var + bn.eps)
    shift = -mean * scale
    if bn.affine:
        gamma = bn.weight.detach().double().cpu().numpy()
        beta = bn.bias.detach().double().cpu().numpy()
        scale, shift = scale * gamma, shift * gamma + beta
    return LinearStep(np.diag(scale), shift)


def compile_plan(
    model: Any,
    *,
    output: OutputKind = "logits",
    approximations: Mapping[str, tuple[int | None, float | None]] | None = None,
    n_inputs: int | None = None,
) -> HEPlan:
    """Convert ``model`` (any ``nn.Module`` whose forward is a chain of supported layers, see
    :mod:`securetrain.he.layers`) into an :class:`HEPlan`.

    A layer HE cannot evaluate raises :class:`HEUnsupportedLayerError` naming its module path and
    type. ``BatchNorm1d`` is folded into the neighbouring linear layer; Flatten/Identity/Dropout
    are no-ops. ``output="logits"`` drops a trailing Sigmoid/Softmax/LogSoftmax (the data owner
    applies it after decryption); ``"probabilities"`` evaluates a fitted polynomial sigmoid under
    encryption (one output only). ``approximations`` maps an activation name *or a layer path* to
    ``(degree, R)`` (see approximations.py).
    """
    return compile_model(model, output=output, approximations=approximations, n_inputs=n_inputs)[0]


def exact_logits(model: Any, features: np.ndarray) -> tuple[np.ndarray, str | None]:
    """The *exact* model (true activations, float64, evaluation mode) up to its final activation:
    (logits, final activation name or None)."""
    import copy

    import torch

    from securetrain.he.layers import split_final, trace_graph, traced_root, truncated

    model = copy.deepcopy(model).cpu().double().eval()  # never mutate the caller's model
    graph, chain = trace_graph(model)
    _, final = split_final([layer for _, layer in chain])
    # Stop at the node feeding the trailing final activation (noops after it change no values).
    nodes = [next(node for node in graph.nodes if node.op == "placeholder")] + [node for node, _ in chain]
    last = len(chain) - 1
    while last >= 0 and chain[last][1].kind == "noop":
        last -= 1
    stop = nodes[last] if final is not None else nodes[-1]  # nodes[i] is the input of chain[i]
    fn = _without_casts(truncated(graph, traced_root(model), stop))
    x = torch.as_tensor(np.asarray(features, dtype=np.float64))
    with torch.no_grad():
        out = fn(x)
    return out.numpy().reshape(len(features), -1), final


#: Tensor methods that only move or cast (``x.float()``, ``x.to(torch.float32)``): the exact model runs
#: in float64 throughout, so they are dropped from the reference graph (a cast to float32 would
#: clash with the float64 weights, and lose precision the encrypted evaluation does not lose).
_CASTS = ("float", "double", "half", "bfloat16", "to", "type", "cpu", "cuda")


def _without_casts(fn: Any) -> Any:
    changed = False
    for node in list(fn.graph.nodes):
        if node.op == "call_method" and node.target in _CASTS:
            node.replace_all_uses_with(node.args[0])
            fn.graph.erase_node(node)
            changed = True
    if changed:
        fn.recompile()
    return fn


def apply_final(logits: np.ndarray, final: str | None) -> np.ndarray:
    """The data owner's exact final non-linearity: the model's own sigmoid (per column) or softmax
    (log_softmax gives probabilities too); without one, sigmoid for one column, else softmax."""
    z = np.asarray(logits, dtype=np.float64)
    if final == "sigmoid" or (final is None and z.shape[1] == 1):  # sigmoid per column (multi-label too)
        return 0.5 * (1.0 + np.tanh(0.5 * z))  # = 1/(1+e^-z) without overflow warnings
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def reference_forward(model: Any, features: np.ndarray, output: OutputKind) -> np.ndarray:
    """The *exact* model (true activations) with the same output semantics as the plan."""
    logits, final = exact_logits(model, features)
    return apply_final(logits, final) if output == "probabilities" else logits

"""Read a PyTorch model as a chain of layers, each classified for HE evaluation.

Any ``nn.Module`` is traced with ``torch.fx`` (standard ``torch.nn`` layers, :mod:`securetrain.he.modules`
activations and user modules without children stay opaque leaves), so ``nn.Sequential`` and models
whose ``forward`` is a straight chain (``self.head(self.trunk(x))``) are read the same way. Each
step gets its **module path** (``"trunk.3"``) and type, so an unsupported layer is named precisely
— before any key or ciphertext exists.

Kinds:

* ``linear`` (``nn.Linear``), ``batchnorm`` (``nn.BatchNorm1d`` with running statistics: an affine
  map at evaluation, folded into the neighbouring linear layer);
* ``noop``: ``nn.Flatten``/``torch.flatten``/``view``/``reshape`` (features are already one row per
  sample), ``nn.Identity``, ``nn.Dropout`` (evaluation mode);
* ``activation``: a name from :data:`securetrain.he.approximations.ACTIVATIONS` (polynomial fit);
* ``poly``: :class:`~securetrain.he.modules.PolyActivation` / ``Square`` (exact);
* ``final``: a trailing ``Sigmoid`` / ``Softmax`` / ``LogSoftmax`` over the classes — applied by the
  data owner after decryption, never approximated unless asked for.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from securetrain.he.approximations import ACTIVATIONS
from securetrain.he.errors import HEModelError, HEUnsupportedLayerError

FINAL_ACTIVATIONS = ("sigmoid", "softmax", "log_softmax")

_MODULE_ACTIVATIONS = {"ReLU": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "SiLU": "silu", "GELU": "gelu",
                       "Softplus": "softplus"}


@dataclass(frozen=True)
class Layer:
    path: str  # module path in the model ("trunk.3"), or the fx node name for a function call
    type_name: str  # "Linear", "BatchNorm1d", "relu", ...
    kind: str  # linear | batchnorm | noop | activation | poly | final
    module: Any = None
    activation: str | None = None  # activation name (kind activation/final)

    def describe(self) -> str:
        return f"'{self.path}' ({self.type_name})"


def unsupported(path: str, type_name: str, why: str = "") -> HEUnsupportedLayerError:
    return HEUnsupportedLayerError(path, type_name, why)


def _classify_module(path: str, m: Any) -> Layer:
    from torch import nn

    from securetrain.he.modules import PolyActivation

    t = type(m).__name__
    if isinstance(m, nn.Linear):
        return Layer(path, t, "linear", m)
    if isinstance(m, nn.BatchNorm1d):
        if m.running_mean is None or m.running_var is None:
            raise unsupported(path, t, "it has no running statistics (track_running_stats=False), so it is not "
                                       "an affine map at evaluation")
        return Layer(path, t, "batchnorm", m)
    if isinstance(m, nn.Flatten | nn.Identity | nn.modules.dropout._DropoutNd):  # dropout: identity at evaluation
        return Layer(path, t, "noop", m)
    if isinstance(m, PolyActivation):
        return Layer(path, t, "poly", m)
    if isinstance(m, nn.Softmax | nn.LogSoftmax):
        if m.dim not in (-1, 1, None):  # None: PyTorch's implicit choice, dim 1 for (batch, classes)
            raise unsupported(path, t, f"softmax over dim {m.dim} is not over the classes")
        return Layer(path, t, "final", m, "softmax" if isinstance(m, nn.Softmax) else "log_softmax")
    if t in _MODULE_ACTIVATIONS and isinstance(m, getattr(nn, t)):
        return Layer(path, t, "activation", m, _MODULE_ACTIVATIONS[t])
    raise unsupported(path, t)


def _function_layer(node: Any) -> Layer | None:
    """A call_function / call_method node as a layer; ``None`` when unsupported."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    name = node.name
    if node.op == "call_function":
        fn = node.target
        acts = {torch.relu: "relu", F.relu: "relu", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
                torch.tanh: "tanh", F.tanh: "tanh", F.gelu: "gelu", F.silu: "silu", F.softplus: "softplus"}
        if fn in acts:
            return Layer(name, acts[fn], "activation", None, acts[fn])
        if fn in (torch.flatten, torch.reshape, torch.squeeze, F.dropout):
            return Layer(name, getattr(fn, "__name__", str(fn)), "noop")
        if fn in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax):
            kind = "softmax" if fn in (torch.softmax, F.softmax) else "log_softmax"
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            if dim not in (-1, 1):
                return None
            return Layer(name, kind, "final", None, kind)
        return None
    if node.op == "call_method":
        m = node.target
        if m in ("relu", "sigmoid", "tanh"):
            return Layer(name, m, "activation", None, m)
        # squeeze: a (N, 1) binary logit as (N,); to/type: dtype or device moves, no values change
        if m in ("flatten", "view", "reshape", "contiguous", "float", "double", "squeeze", "to", "type", "cpu", "cuda"):
            return Layer(name, m, "noop")
        if m in ("softmax", "log_softmax"):
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            return Layer(name, m, "final", None, m) if dim in (-1, 1) else None
    return None


def _is_shape_query(node: Any, shape_nodes: set[Any]) -> bool:
    if node.op == "call_method" and node.target in ("size", "dim"):
        return True
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in ("shape", "ndim"):
        return True
    return node.op == "call_function" and node.target is operator.getitem and bool(node.args) and node.args[0] in shape_nodes


def _tracer_class() -> Any:
    import torch.fx
    from torch import nn

    from securetrain.he.modules import PolyActivation

    class _Tracer(torch.fx.Tracer):
        # Our activations and childless user modules stay opaque: we classify them by type.
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            if isinstance(m, PolyActivation | nn.Sequential):
                return isinstance(m, PolyActivation)
            return super().is_leaf_module(m, qualname) or not any(True for _ in m.children())

    return _Tracer


def trace_graph(model: Any, *, strict: bool = True) -> tuple[Any, list[tuple[Any, Layer]]]:
    """(fx graph, [(node, layer)] along the data chain). Raises :class:`HEModelError`; with
    ``strict=False`` unsupported layers and merges become layers of kind ``"other"`` instead."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise HEModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    root = model
    if not any(True for _ in model.children()):
        root = nn.Sequential(model)  # a bare layer: trace it as a one-layer model, path "0"
    try:
        graph = _tracer_class()().trace(root)
    except Exception as exc:  # fx raises many types for dynamic control flow
        raise HEModelError(
            f"cannot read the structure of {type(model).__name__}.forward ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''})",
            hint="HE evaluation needs a straight chain of layers: pass an nn.Sequential, or evaluate only "
                 "the final linear head (see securetrain.he.split_for_he)",
        ) from exc
    modules = dict(root.named_modules())
    chain: list[tuple[Any, Layer]] = []
    shape_nodes: set[Any] = set()
    current = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if current is not None:
                raise HEModelError(f"{type(model).__name__}.forward takes several inputs; HE evaluation needs one")
            current = node
            continue
        if node.op == "output":
            out = node.args[0]
            if out is not current:
                raise HEModelError(f"{type(model).__name__} does not return the result of its last layer as one "
                                   "tensor (tuple/dict outputs are not supported)")
            continue
        if _is_shape_query(node, shape_nodes):
            shape_nodes.add(node)
            continue
        if node.op == "get_attr":
            if strict:
                raise unsupported(node.target, "parameter used directly in forward",
                                  "only module layers are understood; wrap the computation in nn.Linear")
            shape_nodes.add(node)  # only its consumers matter (they become "other")
            continue
        tensor_args = [a for a in _flat_args(node) if hasattr(a, "op") and a not in shape_nodes]
        where = f"'{node.target}'" if node.op == "call_module" else f"'{node.name}'"
        if tensor_args != [current]:
            if strict:
                raise HEModelError(
                    f"layer {where} does not take exactly the previous layer's output (a residual/skip connection "
                    "or several inputs): HE evaluation needs a straight chain of layers",
                    hint="evaluate only the final linear head (securetrain.he.split_for_he)",
                )
            layer = Layer(where.strip("'"), "several inputs", "other")
        else:
            try:
                if node.op == "call_module":
                    layer = _classify_module(str(node.target), modules[str(node.target)])
                else:
                    maybe = _function_layer(node)
                    if maybe is None:
                        raise unsupported(node.name, str(getattr(node.target, "__name__", node.target)))
                    layer = maybe
            except HEUnsupportedLayerError as exc:
                if strict:
                    raise
                layer = Layer(exc.layer_path, exc.layer_type, "other")
        chain.append((node, layer))
        current = node
    return graph, chain


def _flat_args(node: Any) -> list[Any]:
    out: list[Any] = []

    def walk(a: Any) -> None:
        if isinstance(a, list | tuple):
            for b in a:
                walk(b)
        elif isinstance(a, dict):
            for b in a.values():
                walk(b)
        else:
            out.append(a)

    walk(node.args)
    walk(node.kwargs)
    return out


def trace_layers(model: Any) -> list[Layer]:
    """The model as a chain of classified layers (see module doc)."""
    return [layer for _, layer in trace_graph(model)[1]]


def split_final(layers: list[Layer]) -> tuple[list[Layer], str | None]:
    """(layers without a trailing final activation, that activation or None). A softmax anywhere
    else is refused; a trailing sigmoid counts as the final activation."""
    body = list(layers)
    tail_noops: list[Layer] = []
    while body and body[-1].kind == "noop":
        tail_noops.append(body.pop())
    final = None
    if body and (body[-1].kind == "final" or (body[-1].kind == "activation" and body[-1].activation == "sigmoid")):
        final = body.pop().activation
    for layer in body:
        if layer.kind == "final":
            raise unsupported(layer.path, layer.type_name, "softmax is only supported as the model's last layer "
                                                           "(applied by the data owner after decryption)")
    return body + tail_noops[::-1], final


def is_approximated(layer: Layer) -> bool:
    return layer.kind == "activation" and layer.activation in ACTIVATIONS


def truncated(graph: Any, root: Any, stop: Any) -> Any:
    """A ``torch.fx.GraphModule`` computing the value of node ``stop`` (sharing ``root``'s
    parameters); ``stop`` = the placeholder gives the identity."""
    import torch.fx

    new = torch.fx.Graph()
    env: dict[Any, Any] = {}
    for node in graph.nodes:
        if node.op == "output":
            break
        env[node] = new.node_copy(node, lambda n: env[n])
        if node is stop:
            break
    new.output(env[stop])
    return torch.fx.GraphModule(root, new)


def traced_root(model: Any) -> Any:
    """The module :func:`trace_graph` traced (a bare layer is wrapped in ``nn.Sequential``)."""
    from torch import nn

    return nn.Sequential(model) if not any(True for _ in model.children()) else model


def layer_module(layer: Layer) -> Any:
    """An ``nn.Module`` doing what ``layer`` does (function calls become modules)."""
    from torch import nn

    if layer.module is not None:
        return layer.module
    if layer.kind == "noop":
        return nn.Flatten()
    if layer.kind == "final":
        return nn.Sigmoid() if layer.activation == "sigmoid" else (
            nn.Softmax(dim=-1) if layer.activation == "softmax" else nn.LogSoftmax(dim=-1))
    names = {v: k for k, v in _MODULE_ACTIVATIONS.items()}
    return getattr(nn, names[str(layer.activation)])()

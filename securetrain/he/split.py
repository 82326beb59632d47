"""Split a user's model into a plaintext trunk (run by the data owner) and an HE-evaluable tail.

``trunk, tail = split_for_he(model)``; then ``tail(trunk(x)) == model(x)`` and
``evaluate_encrypted(tail, trunk(x), y)`` scores the tail on encrypted trunk features.
"""

from __future__ import annotations

from typing import Any

from securetrain.he.errors import HEModelError
from securetrain.he.layers import Layer, layer_module, trace_graph, traced_root, truncated

#: Layers the tail may hold when ``exact=True``: HE computes them without approximation.
_EXACT_KINDS = ("linear", "batchnorm", "poly", "noop")
_HEAD_NAMES = ("head", "fc", "classifier", "linear", "out", "output")


class _Captured(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__("captured")
        self.value = value


def _input_of_head(model: Any, head: Any) -> Any:
    """A trunk for a model fx cannot trace: runs ``model`` and returns what enters ``head``."""
    from torch import nn

    class InputOfHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: Any) -> Any:
            def grab(_m: Any, args: tuple[Any, ...]) -> None:
                raise _Captured(args[0])

            handle = head.register_forward_pre_hook(grab)
            try:
                self.model(x)
            except _Captured as got:
                return got.value
            finally:
                handle.remove()
            raise HEModelError(f"{type(model).__name__}.forward never called its head layer")

    return InputOfHead()


def split_for_he(model: Any, *, exact: bool = True) -> tuple[Any, Any]:
    """``(trunk, tail)`` with ``tail(trunk(x)) == model(x)``.

    The tail is the longest suffix of the model that HE evaluates: with ``exact=True`` (default)
    only layers computed exactly (Linear, BatchNorm1d, PolyActivation/Square, no-ops) plus a
    trailing Sigmoid/Softmax/LogSoftmax (the data owner applies it after decryption); with
    ``exact=False`` also polynomial-approximated activations (ReLU, Tanh, …) between linear layers.
    The tail starts at a Linear (or BatchNorm1d): leading no-ops (Flatten, Dropout) and activations
    stay in the trunk, where the data owner computes them exactly. The trunk
    shares the model's parameters; the tail is an ``nn.Sequential`` of the model's own modules.

    Works for ``nn.Sequential`` and any model whose ``forward`` is a straight chain (traced with
    torch.fx); a model fx cannot trace is split at a final ``nn.Linear`` attribute named one of
    ``head, fc, classifier, linear, out, output``. Raises :class:`HEModelError` when the model does
    not end in a linear head.
    """
    from torch import nn

    try:
        graph, chain = trace_graph(model, strict=False)
    except HEModelError as exc:
        head = next((getattr(model, n) for n in _HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None)
        if head is None:
            raise HEModelError(
                f"cannot split {type(model).__name__}: {exc}",
                hint="give the model a final nn.Linear attribute named 'head' (or fc/classifier), or pass an nn.Sequential",
            ) from exc
        return _input_of_head(model, head), nn.Sequential(head)
    allowed = _EXACT_KINDS if exact else (*_EXACT_KINDS, "activation")
    start = len(chain)
    seen_final = False
    while start > 0:
        layer = chain[start - 1][1]
        trailing = all(later.kind == "noop" for _, later in chain[start:])
        if not seen_final and trailing and (layer.kind == "final" or (layer.kind == "activation"
                                                                      and layer.activation == "sigmoid")):
            seen_final = True
        elif layer.kind not in allowed:
            break
        start -= 1
    while start < len(chain) and chain[start][1].kind not in ("linear", "batchnorm"):
        start += 1  # Flatten & co., and activations the data owner computes exactly, belong to the trunk
    tail_layers: list[Layer] = [layer for _, layer in chain[start:]]
    if not any(layer.kind == "linear" for layer in tail_layers):
        last = chain[-1][1].describe() if chain else "nothing"
        raise HEModelError(
            f"{type(model).__name__} does not end in a linear head (its last layer is {last})",
            hint="HE evaluates a final nn.Linear (optionally with BatchNorm1d / polynomial activations before it)",
        )
    placeholder = next(node for node in graph.nodes if node.op == "placeholder")
    stop = chain[start - 1][0] if start > 0 else placeholder
    trunk = nn.Identity() if start == 0 else truncated(graph, traced_root(model), stop)
    tail = nn.Sequential(*[layer_module(layer) for layer in tail_layers])
    return trunk, tail

"""Model files for the evaluator: safetensors weights + JSON architecture metadata, no pickle.

One file: the tensors of the ``nn.Sequential`` state dict (keys like ``"0.weight"``), and in the
safetensors header metadata the key ``"securetrain.model"`` holding JSON::

    {"format": "securetrain.sequential/1",
     "layers": [{"type": "Flatten"},
                {"type": "BatchNorm1d", "num_features": 30, "eps": 1e-05, "affine": true},
                {"type": "Linear", "in_features": 30, "out_features": 8, "bias": true},
                {"type": "Sigmoid"},
                {"type": "PolyActivation", "coeffs": [0.0, 0.5, 0.125]},
                {"type": "Linear", "in_features": 8, "out_features": 1, "bias": true}]}

Layer types and their fields (exactly these; anything else is refused when loading):
``Linear{in_features, out_features, bias}``, ``BatchNorm1d{num_features, eps, affine}`` (evaluation
form: running mean/variance, plus weight/bias when affine; always loaded with running statistics),
``Flatten`` (``nn.Flatten()``: the identity on (N, features)), ``Dropout{p}`` (identity at
evaluation), ``Softmax{dim}`` / ``LogSoftmax{dim}`` (dim 1 or -1, the model's final activation),
``PolyActivation{coeffs}``, ``Square``, ``Identity``, ``ReLU``, ``Sigmoid``, ``Tanh``, ``SiLU``,
``GELU``, ``Softplus``. Only these are ever instantiated: loading never executes code from the file.

:func:`save_sequential` takes an ``nn.Sequential`` of these layers, or any model
:func:`securetrain.he.compile_plan` reads (nested ``nn.Sequential``, a custom ``forward`` that is a
straight chain, ``torch.relu``/``x.view(...)`` calls): the chain is written as one flat
``nn.Sequential`` of equivalent layers (reshapes become ``Flatten``; casts, device moves and
``squeeze`` change no values and are left out).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from securetrain.he.errors import HEFormatError, HEModelError
from securetrain.io.atomic import atomic_write_bytes

MODEL_FORMAT = "securetrain.sequential/1"
META_KEY = "securetrain.model"
_PLAIN_ACTIVATIONS = ("Identity", "ReLU", "Sigmoid", "Tanh", "SiLU", "GELU", "Softplus")
#: The fields each layer type carries (besides "type"); a spec with other fields is refused.
_FIELDS: dict[str, frozenset[str]] = {
    "Linear": frozenset({"in_features", "out_features", "bias"}),
    "BatchNorm1d": frozenset({"num_features", "eps", "affine"}),
    "Flatten": frozenset(),
    "Dropout": frozenset({"p"}),
    "Softmax": frozenset({"dim"}),
    "LogSoftmax": frozenset({"dim"}),
    "PolyActivation": frozenset({"coeffs"}),
    "Square": frozenset(),
    **{name: frozenset() for name in _PLAIN_ACTIVATIONS},
}
#: Function-call no-ops of a traced model that reshape (saved as Flatten); the others (casts,
#: device moves, squeeze, contiguous, dropout) change no values at evaluation and are left out.
_RESHAPES = ("flatten", "view", "reshape")
_BN_COUNTER = "num_batches_tracked"  # a training-time counter: not part of the evaluation form


def _spec(m: Any, where: str = "") -> dict[str, Any] | None:
    """The file spec of layer ``m``; ``None`` when its type is not one of the file's types."""
    from torch import nn

    from securetrain.he.modules import PolyActivation, Square

    at = f"layer {where!r} " if where else ""
    if isinstance(m, nn.Linear):
        return {"type": "Linear", "in_features": m.in_features, "out_features": m.out_features,
                "bias": m.bias is not None}
    if isinstance(m, nn.BatchNorm1d):
        if m.running_mean is None or m.running_var is None:
            raise HEModelError(f"cannot save {at}BatchNorm1d without running statistics (track_running_stats=False): "
                               "it is not an affine map at evaluation")
        return {"type": "BatchNorm1d", "num_features": m.num_features, "eps": float(m.eps), "affine": bool(m.affine)}
    if isinstance(m, nn.Flatten):
        if (m.start_dim, m.end_dim) != (1, -1):
            raise HEModelError(f"cannot save {at}Flatten(start_dim={m.start_dim}, end_dim={m.end_dim}): only "
                               "nn.Flatten() (one row per sample) is an identity on the (N, features) inputs")
        return {"type": "Flatten"}
    if isinstance(m, Square):
        return {"type": "Square"}
    if isinstance(m, PolyActivation):
        return {"type": "PolyActivation", "coeffs": list(m.coeffs)}
    if isinstance(m, nn.modules.dropout._DropoutNd):  # every dropout is the identity at evaluation
        return {"type": "Dropout", "p": float(m.p)}
    if isinstance(m, nn.Softmax | nn.LogSoftmax):
        if m.dim not in (-1, 1, None):
            raise HEModelError(f"cannot save {at}{type(m).__name__}(dim={m.dim}): only a softmax over the classes "
                               "(dim 1 or -1) is a model's final activation")
        return {"type": type(m).__name__, "dim": 1 if m.dim is None else int(m.dim)}
    if type(m).__name__ in _PLAIN_ACTIVATIONS and isinstance(m, getattr(nn, type(m).__name__)):
        return {"type": type(m).__name__}
    return None


def _as_chain(model: Any) -> Any:
    """``model`` as a flat ``nn.Sequential`` of layers the file format carries.

    An ``nn.Sequential`` of such layers (or one such layer) is written as it is, so existing files
    keep their bytes; anything else is traced like :func:`~securetrain.he.compile_plan` does, which
    refuses an unsupported layer with :class:`HEUnsupportedLayerError` naming its module path."""
    from torch import nn

    from securetrain.he.layers import layer_module, trace_graph

    if not isinstance(model, nn.Module):
        raise HEModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Sequential) and all(_spec(m, str(i)) is not None for i, m in enumerate(model)):
        return model
    if not isinstance(model, nn.Sequential) and _spec(model) is not None:
        return nn.Sequential(model)
    mods: list[nn.Module] = []
    for _node, layer in trace_graph(model)[1]:
        if layer.module is None and layer.kind == "noop":
            if layer.type_name in _RESHAPES:
                mods.append(nn.Flatten())
            continue
        m = layer_module(layer)
        if _spec(m, layer.path) is None:  # pragma: no cover - the tracer classifies the same types
            raise HEModelError(f"cannot save layer {layer.describe()}: not supported for HE evaluation")
        mods.append(m)
    return nn.Sequential(*mods)


def _describe(seq: Any) -> list[dict[str, Any]]:
    layers: list[dict[str, Any]] = []
    for i, m in enumerate(seq):
        spec = _spec(m, str(i))
        if spec is None:
            raise HEModelError(f"cannot save layer {type(m).__name__}: not supported for HE evaluation")
        layers.append(spec)
    return layers


def model_bytes(model: Any) -> bytes:
    """The exact bytes :func:`save_sequential` writes (sha256 of these = the model digest)."""
    import torch
    from safetensors.torch import save
    from torch.nn.parameter import is_lazy

    seq = _as_chain(model)
    meta = {"format": MODEL_FORMAT, "layers": _describe(seq)}
    for k, v in seq.state_dict().items():
        if is_lazy(v):
            raise HEModelError(f"cannot save {k!r}: it is uninitialised (a lazy module that never saw a batch)",
                               hint="run the model once on a dummy batch (or load the trained weights) first")
    tensors = {k: v.detach().to(torch.float64).cpu().contiguous() for k, v in seq.state_dict().items()
               if not k.endswith("." + _BN_COUNTER)}
    return save(tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True)})


def save_sequential(model: Any, path: str | os.PathLike[str]) -> str:
    """Write ``model`` atomically; returns the file's SHA-256."""
    data = model_bytes(model)
    atomic_write_bytes(path, data, mode=0o644)
    return hashlib.sha256(data).hexdigest()


def _build(spec: Any, index: int, p: Path) -> Any:
    """One layer from its spec; unknown types and fields are refused."""
    import torch
    from torch import nn

    from securetrain.he.modules import PolyActivation, Square

    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise HEFormatError(f"{p}: layer {index} is not an object with a 'type'")
    t = spec["type"]
    if t not in _FIELDS:
        raise HEModelError(f"{p}: unsupported layer type {t!r}")
    extra = set(spec) - {"type"} - _FIELDS[t]
    missing = _FIELDS[t] - set(spec)
    if extra or missing:
        raise HEFormatError(f"{p}: layer {index} ({t}) has unknown fields {sorted(extra)} / lacks {sorted(missing)}")
    if t == "Linear":
        return nn.Linear(_int(spec["in_features"]), _int(spec["out_features"]), bias=_bool(spec["bias"]),
                         dtype=torch.float64)
    if t == "BatchNorm1d":
        eps = float(spec["eps"])
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a positive number, got {spec['eps']!r}")
        return nn.BatchNorm1d(_int(spec["num_features"]), eps=eps, affine=_bool(spec["affine"]),
                              track_running_stats=True, dtype=torch.float64)
    if t == "Flatten":
        return nn.Flatten()
    if t == "Square":
        return Square()
    if t == "PolyActivation":
        return PolyActivation([float(c) for c in spec["coeffs"]])
    if t == "Dropout":
        return nn.Dropout(float(spec["p"]))
    if t in ("Softmax", "LogSoftmax"):
        if spec["dim"] not in (1, -1) or isinstance(spec["dim"], bool):
            raise ValueError(f"{t} over dim {spec['dim']!r} is not over the classes")
        return getattr(nn, t)(dim=spec["dim"])
    return getattr(nn, t)()


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true/false, got {v!r}")
    return v


def _check_batchnorm(m: Any, index: int, p: Path) -> None:
    import torch

    var = m.running_var
    if not (bool(torch.all(torch.isfinite(var))) and bool(torch.all(var >= 0))
            and bool(torch.all(torch.isfinite(m.running_mean)))):
        raise HEFormatError(f"{p}: layer {index} (BatchNorm1d) has a running variance that is negative or not finite, "
                            "or a running mean that is not finite")


def load_sequential(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """Rebuild the ``nn.Sequential``; returns it and the file's SHA-256."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load
    from torch import nn

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise HEFormatError(f"cannot read model file {p}: {exc.strerror}") from exc
    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta_raw = json.loads(data[8:8 + header_len]).get("__metadata__", {}).get(META_KEY)
        meta = json.loads(meta_raw) if meta_raw else None
    except (SafetensorError, ValueError, UnicodeDecodeError) as exc:
        raise HEFormatError(f"{p} is not a valid safetensors model file ({exc.__class__.__name__})") from exc
    if not isinstance(meta, dict) or meta.get("format") != MODEL_FORMAT or not isinstance(meta.get("layers"), list):
        raise HEFormatError(f"{p} has no {META_KEY!r} metadata in format {MODEL_FORMAT!r}",
                            hint="write model files with securetrain.he.save_sequential")
    layers = []
    for i, spec in enumerate(meta["layers"]):
        try:
            layers.append(_build(spec, i, p))
        except (TypeError, ValueError) as exc:
            raise HEFormatError(f"{p}: layer {i} has an invalid field ({exc})") from exc
    try:
        for i, m in enumerate(layers):
            if isinstance(m, nn.BatchNorm1d):  # the counter is not saved; it plays no part at evaluation
                key = f"{i}.{_BN_COUNTER}"
                if key in tensors:
                    raise ValueError(f"unexpected tensor {key!r}")
                tensors[key] = torch.tensor(0, dtype=torch.long)
        seq = nn.Sequential(*layers)
        seq.load_state_dict(tensors, strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise HEFormatError(f"{p}: weights do not match the declared layers ({exc.__class__.__name__}: "
                            f"{str(exc).splitlines()[0][:200]})") from exc
    for i, m in enumerate(seq):
        if isinstance(m, nn.BatchNorm1d):
            _check_batchnorm(m, i, p)
    return seq.eval(), hashlib.sha256(data).hexdigest()

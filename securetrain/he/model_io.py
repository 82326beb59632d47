"""Model files for the evaluator: safetensors weights + JSON architecture metadata, no pickle.

One file: the tensors of the ``nn.Sequential`` state dict (keys like ``"0.weight"``), and in the
safetensors header metadata the key ``"securetrain.model"`` holding JSON::

    {"format": "securetrain.sequential/1",
     "layers": [{"type": "Linear", "in_features": 30, "out_features": 8, "bias": true},
                {"type": "Sigmoid"},
                {"type": "PolyActivation", "coeffs": [0.0, 0.5, 0.125]},
                {"type": "Linear", "in_features": 8, "out_features": 1, "bias": true}]}

Activation types: Identity, Dropout, ReLU, Sigmoid, Tanh, SiLU, GELU, Softplus, Square,
PolyActivation. Only these are ever instantiated: loading never executes code from the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from securetrain.he.errors import HEFormatError, HEModelError
from securetrain.io.atomic import atomic_write_bytes

MODEL_FORMAT = "securetrain.sequential/1"
META_KEY = "securetrain.model"
_PLAIN_ACTIVATIONS = ("Identity", "ReLU", "Sigmoid", "Tanh", "SiLU", "GELU", "Softplus")


def _describe(model: Any) -> list[dict[str, Any]]:
    from torch import nn

    from securetrain.he.modules import PolyActivation, Square

    mods = list(model) if isinstance(model, nn.Sequential) else [model]
    layers: list[dict[str, Any]] = []
    for m in mods:
        if isinstance(m, nn.Sequential):
            raise HEModelError("nested nn.Sequential cannot be saved; flatten the model first")
        if isinstance(m, nn.Linear):
            layers.append({"type": "Linear", "in_features": m.in_features, "out_features": m.out_features,
                           "bias": m.bias is not None})
        elif isinstance(m, Square):
            layers.append({"type": "Square"})
        elif isinstance(m, PolyActivation):
            layers.append({"type": "PolyActivation", "coeffs": list(m.coeffs)})
        elif isinstance(m, nn.Dropout):
            layers.append({"type": "Dropout", "p": m.p})
        elif type(m).__name__ in _PLAIN_ACTIVATIONS:
            layers.append({"type": type(m).__name__})
        else:
            raise HEModelError(f"cannot save layer {type(m).__name__}: not supported for HE evaluation")
    return layers


def model_bytes(model: Any) -> bytes:
    """The exact bytes :func:`save_sequential` writes (sha256 of these = the model digest)."""
    import torch
    from safetensors.torch import save
    from torch import nn

    seq = model if isinstance(model, nn.Sequential) else nn.Sequential(model)
    meta = {"format": MODEL_FORMAT, "layers": _describe(seq)}
    tensors = {k: v.detach().to(torch.float64).cpu().contiguous() for k, v in seq.state_dict().items()}
    return save(tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True)})


def save_sequential(model: Any, path: str | os.PathLike[str]) -> str:
    """Write ``model`` atomically; returns the file's SHA-256."""
    data = model_bytes(model)
    atomic_write_bytes(path, data, mode=0o644)
    return hashlib.sha256(data).hexdigest()


def load_sequential(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """Rebuild the ``nn.Sequential``; returns it and the file's SHA-256."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load
    from torch import nn

    from securetrain.he.modules import PolyActivation, Square

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
    layers: list[nn.Module] = []
    try:
        for spec in meta["layers"]:
            t = spec["type"]
            if t == "Linear":
                layers.append(nn.Linear(int(spec["in_features"]), int(spec["out_features"]), bias=bool(spec["bias"]),
                                        dtype=torch.float64))
            elif t == "Square":
                layers.append(Square())
            elif t == "PolyActivation":
                layers.append(PolyActivation([float(c) for c in spec["coeffs"]]))
            elif t == "Dropout":
                layers.append(nn.Dropout(float(spec["p"])))
            elif t in _PLAIN_ACTIVATIONS:
                layers.append(getattr(nn, t)())
            else:
                raise HEModelError(f"{p}: unsupported layer type {t!r}")
        seq = nn.Sequential(*layers)
        seq.load_state_dict(tensors, strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise HEFormatError(f"{p}: weights do not match the declared layers ({exc.__class__.__name__}: "
                            f"{str(exc).splitlines()[0][:200]})") from exc
    return seq.eval(), hashlib.sha256(data).hexdigest()

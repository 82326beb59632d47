"""Flatten training state into the safetensors data model (tensors + string metadata) and back.

Nothing here uses pickle: optimizer tensors become named tensors, everything else (param groups,
scalar state, scaler state, RNG bookkeeping) becomes JSON with tuples tagged so they round-trip.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from securetrain.training.errors import CheckpointCorruptError, TrainingError

_TUPLE = "__tuple__"


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        raise TrainingError("cannot store a tensor inside JSON metadata", hint="keep tensors in optimizer state, not param_groups")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TrainingError(f"cannot checkpoint a value of type {type(value).__name__} in optimizer/scaler state")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(_encode(value), sort_keys=True, separators=(",", ":"))


def loads(text: str) -> Any:
    try:
        return _decode(json.loads(text))
    except (json.JSONDecodeError, TypeError) as exc:
        raise CheckpointCorruptError(f"checkpoint metadata is not valid JSON: {exc}") from None


def detach_for_save(t: torch.Tensor) -> torch.Tensor:
    # A copy, so the snapshot cannot change while it is being serialised. Copies of several tensors
    # share nothing: use snapshot_tensors for a state dict, which keeps tied tensors tied.
    return t.detach().to("cpu", copy=True).contiguous()


def snapshot_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy of every tensor (as :func:`detach_for_save`), in the same order, keeping ties.

    Names that are one tensor (weight tying: ``head.weight`` is ``embed.weight``; detected as the
    codec does, :func:`securetrain.crypto._container.codec.shared_aliases`) get **one** copy under
    all of them, so a store writes it once (``securetrain.aliases``) and a reader hands the same
    tensor back under every name. Tensors that merely overlap get copies of their own.
    """
    from securetrain.crypto._container.codec import shared_aliases  # crypto imports training: lazily

    aliases = shared_aliases(tensors)
    kept = {name: detach_for_save(t) for name, t in tensors.items() if name not in aliases}
    return {name: kept[aliases.get(name, name)] for name in tensors}


def flatten_optimizer(state_dict: Mapping[str, Any], prefix: str = "optim/") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    tensor_keys: dict[str, list[str]] = {}
    for pid, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}{pid}/{key}"] = detach_for_save(value)
                tensor_keys.setdefault(str(pid), []).append(key)
            else:
                scalars.setdefault(str(pid), {})[key] = value
    meta = {"param_groups": state_dict["param_groups"], "scalars": scalars, "tensor_keys": tensor_keys}
    return tensors, meta


def unflatten_optimizer(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], prefix: str = "optim/") -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    try:
        for pid, keys in meta["tensor_keys"].items():
            for key in keys:
                state.setdefault(int(pid), {})[key] = tensors[f"{prefix}{pid}/{key}"]
        for pid, entries in meta["scalars"].items():
            state.setdefault(int(pid), {}).update(entries)
        return {"state": state, "param_groups": meta["param_groups"]}
    except KeyError as exc:
        raise CheckpointCorruptError(f"checkpoint lacks optimizer tensor {exc}") from None

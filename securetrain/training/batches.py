"""How the Trainer reads a user's batch and calls the user's model.

A batch is ``(x, y, ...)`` or a dict with an input key (``inputs``/``pixels``/``features``, or
every entry but the target) and a target key (``label``/``labels``/``target``); a ``forward`` with
several parameters gets a tuple spread positionally or a dict by name. Validation (``predict_fn``)
and the default losses (:mod:`securetrain.training.losses`) read batches the same way.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from securetrain.training.errors import TrainingError

INPUT_KEYS = ("inputs", "pixels", "features")
TARGET_KEYS = ("label", "labels", "target")


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(x, y)`` from a ``(x, y, ...)`` tuple/list or a dict keyed as documented."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        x = next((batch[k] for k in INPUT_KEYS if k in batch), None)
        target_key = next((k for k in TARGET_KEYS if k in batch), None)
        if x is None and target_key is not None and len(batch) > 1:
            # {"image": ..., "clinical": ..., "label": ...}: every other entry is an input, passed to
            # the model by name (call_model) when its forward takes those names.
            x = {k: v for k, v in batch.items() if k != target_key}
        if x is not None and target_key is not None:
            return x, batch[target_key]
        raise TrainingError(
            f"cannot find inputs/targets in batch keys {sorted(map(str, batch))}",
            hint=f"use input keys {INPUT_KEYS} and target keys {TARGET_KEYS}, or pass loss_fn",
        )
    raise TrainingError(
        f"unsupported batch type {type(batch).__name__}", hint="yield (x, y) tuples or dicts, or pass loss_fn"
    )


def compiled_inner(model: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, or None for any other model.
    (Only looked up when torch.compile was used, i.e. ``torch._dynamo`` is imported already.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return model._orig_mod if wrapper is not None and isinstance(model, wrapper) else None


def strip_compile(model: nn.Module) -> nn.Module:
    """``model`` without its ``torch.compile`` wrapper(s): the user's module, whose parameter names
    (``0.weight``, not ``_orig_mod.0.weight``) are the ones checkpoints hold."""
    inner = compiled_inner(model)
    while inner is not None:
        model, inner = inner, compiled_inner(inner)
    return model


_SIGNATURES: dict[type, inspect.Signature | None] = {}


def _forward_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature of the user's ``forward`` (under DDP's ``.module`` / Opacus' ``._module`` /
    torch.compile's ``._orig_mod``)."""
    inner: Any = model
    for _ in range(6):
        nxt = getattr(inner, "module", None) if isinstance(inner, nn.parallel.DistributedDataParallel) else None
        nxt = nxt if nxt is not None else compiled_inner(inner)
        nxt = nxt if nxt is not None else inner.__dict__.get("_modules", {}).get("_module")
        if not isinstance(nxt, nn.Module):
            break
        inner = nxt
    kind = type(inner)
    if kind not in _SIGNATURES:
        try:
            _SIGNATURES[kind] = inspect.signature(inner.forward)
        except (TypeError, ValueError):
            _SIGNATURES[kind] = None
    return _SIGNATURES[kind]


def call_model(model: nn.Module, x: Any) -> Any:
    """``model(x)``; inputs for a ``forward`` with several parameters are spread over them: a tuple/list
    as positional arguments (``forward(self, image, clinical)`` with ``x = (image, clinical)``), a dict
    as keyword arguments when its keys are the parameter names. Any other forward gets ``x`` whole."""
    if isinstance(x, torch.Tensor):
        return model(x)
    sig = _forward_signature(model)
    if sig is not None and isinstance(x, (tuple, list, Mapping)):
        params = list(sig.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
        if isinstance(x, (tuple, list)) and (
                (len(required) >= 2 and len(required) <= len(x) <= len(positional)) or (var_pos and not required)):
            return model(*x)
        if isinstance(x, Mapping) and all(isinstance(k, str) for k in x):
            names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
            needed = {p.name for p in params if p.default is p.empty
                      and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            if needed <= set(x) and (set(x) <= names or var_kw) and (len(names) >= 2 or set(x) == names):
                return model(**x)
            if needed and needed <= set(x) and len(names) >= 2:
                # forward(image, clinical) and a batch that also carries bookkeeping (record ids): the
                # names forward takes, by keyword.
                return model(**{k: v for k, v in x.items() if k in names})
    return model(x)


def default_predict(model: nn.Module, batch: Any) -> tuple[Any, Any]:
    """Default validation step: ``(model(x), y)`` with ``x, y`` from :func:`split_batch` (the model
    called as by :func:`call_model`); a tuple/dict output is kept whole for ``metrics_fn`` (the
    default metrics score its ``logits`` entry)."""
    x, y = split_batch(batch)
    return call_model(model, x), y


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """Move a batch (a tensor, or nested tuples/lists/dicts of tensors) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def batch_len(batch: Any) -> int:
    """Number of samples in a batch (the leading dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return next((batch_len(v) for v in batch.values() if isinstance(v, torch.Tensor)), 0)
    if isinstance(batch, (list, tuple)) and batch:
        return batch_len(batch[0])
    return 0

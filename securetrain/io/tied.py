"""Tied tensors (several names over one tensor: weight tying) in the safetensors data model.

safetensors holds each tensor's bytes once per name and refuses shared storage. Like
``safetensors.torch.save_model``, a writer keeps the first name of each tied set in sorted order and
records the others in the metadata key :data:`ALIASES_KEY` as JSON ``{alias: kept name}``; a reader
puts each alias back as the very same tensor. Used by the encrypted container's codec and by the
plain :class:`securetrain.training.safetensors_store.SafetensorsCheckpointStore`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

# In ``__metadata__``: JSON {alias: kept name} of tensors written once for several names (tied weights).
ALIASES_KEY = "securetrain.aliases"


def shared_aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{name: kept name}`` for tensors that are the same tensor as another one (tied weights).

    Only identical views are one tensor: same device and storage (``safetensors.torch.storage_ptr``),
    same first element, dtype, shape, strides and conj/neg bits. Of each such set the first name
    in sorted order is written, as ``safetensors.torch.save_model`` does, so the decrypted payload
    is the file ``save_model`` writes and ``safetensors.torch.load_model`` re-ties it. Tensors that
    merely overlap (a slice or reshape of another) are written as their own copies: safetensors
    cannot express them, and ``save_model``'s dropping of them relies on the model re-tying them.
    (safetensors' ``_find_shared_tensors`` is not used: it raises on non-contiguous views that
    share storage, such as ``w`` next to ``w.t()``.)
    """
    from safetensors.torch import storage_ptr

    views: dict[tuple[Any, ...], list[str]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue  # nothing to store twice
        key = (t.device, storage_ptr(t), t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())
        views.setdefault(key, []).append(name)
    aliases: dict[str, str] = {}
    for names in views.values():
        keep, *rest = sorted(names)
        aliases.update(dict.fromkeys(rest, keep))
    return aliases



def aliases_json(aliases: Mapping[str, str]) -> str:
    """The value of :data:`ALIASES_KEY` for ``aliases`` (from :func:`shared_aliases`)."""
    return json.dumps(dict(aliases), sort_keys=True, separators=(",", ":"))

def restore_aliases(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict[str, torch.Tensor],
                                                                                      dict[str, str]]:
    """The reader's side of :func:`shared_aliases`: every alias becomes the very tensor it names
    (ties survive a round trip), in name order; the alias map is removed from the metadata. A
    malformed map (not JSON, an alias naming a stored tensor or pointing at a missing one) is a
    ``ValueError``."""
    raw = meta.pop(ALIASES_KEY, None)
    if raw is None:
        return tensors, meta
    try:
        aliases = json.loads(raw)
    except ValueError:
        raise ValueError("the tensor alias map in the metadata is not JSON") from None
    if not isinstance(aliases, dict):
        raise ValueError("the tensor alias map in the metadata is not a JSON object")
    for alias, kept in aliases.items():
        if not isinstance(kept, str) or not alias or alias == "__metadata__" or alias in tensors or kept not in tensors:
            raise ValueError(f"tensor alias {alias!r} -> {kept!r} does not name a stored tensor "
                                     "under a new name")
    whole = {**tensors, **{alias: tensors[kept] for alias, kept in aliases.items()}}
    return {name: whole[name] for name in sorted(whole)}, meta

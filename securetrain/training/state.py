"""Flatten training state into the safetensors data model (tensors + string metadata) and back.

Nothing here uses pickle: optimizer tensors become named tensors, everything else (param groups,
scalar state, scaler state, RNG bookkeeping) becomes JSON in which the types JSON lacks are tagged
so they round-trip exactly: ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}`` (a dict
with non-string keys, e.g. ``{0: ...}``, or one that looks like a tag) and ``{"__tensor__": name}``
(a tensor sealed beside the JSON, see :func:`flatten_optimizer`). A value of any other type is
refused with :class:`UncheckpointableStateError` naming its path (``state/0/old_dirs/2``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from securetrain.io.tied import shared_aliases
from securetrain.training.errors import CheckpointCorruptError, UncheckpointableStateError

_TUPLE = "__tuple__"
_DICT = "__dict__"  # a dict whose keys are not all strings (or that looks like a tag): [[key, value], ...]
_TENSOR = "__tensor__"  # a tensor stored beside the JSON: {"__tensor__": "<tensor name>"}
_TAGS = frozenset({_TUPLE, _DICT, _TENSOR})
_SCALARS = (type(None), bool, int, float, str)
_HOLDS = "a checkpoint holds tensors, lists/tuples/dicts of them, int, float, bool, str and None"


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor stood in a structure flattened by :func:`flatten_optimizer`: ``name`` is its key
    among the sealed tensors (JSON ``{"__tensor__": name}``)."""

    name: str


def _where(path: str) -> str:
    return path or "the top level"


def _sub(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _encode(value: Any, path: str = "") -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    # Subclasses are stored as their base type, as JSON always stored them (OrderedDict and
    # defaultdict in accountant/scheduler states, IntEnum, numpy's float64, namedtuples).
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, _sub(path, i)) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, _sub(path, i)) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(type(k) is str for k in value) and not (len(value) == 1 and set(value) <= _TAGS):
            return {k: _encode(v, _sub(path, k)) for k, v in value.items()}
        for k in value:
            if type(k) not in _SCALARS:
                raise UncheckpointableStateError(
                    f"{_where(path)}: a dict key of type {kind_name(k)} ({k!r}) cannot be checkpointed",
                    hint=f"use str, int, float, bool or None keys; {_HOLDS}")
        return {_DICT: [[k, _encode(v, _sub(path, k))] for k, v in value.items()]}
    if kind is TensorRef:
        return {_TENSOR: value.name}
    if isinstance(value, torch.Tensor):
        raise UncheckpointableStateError(f"{_where(path)}: a tensor cannot be stored inside JSON metadata",
                                         hint="flatten it first (flatten_optimizer seals tensors beside the JSON)")
    raise UncheckpointableStateError(f"{_where(path)}: a value of type {kind_name(value)} cannot be checkpointed",
                                     hint=f"{_HOLDS}; convert it (e.g. int(x), float(x), list(x)) or keep it "
                                          "out of the optimizer/scaler/callback state")


def kind_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == _TUPLE:
                return tuple(_decode(v) for v in inner)
            if tag == _DICT:
                return {k: _decode(v) for k, v in inner}
            if tag == _TENSOR:
                return TensorRef(inner)
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def dumps(value: Any) -> str:
    # Insertion order, not sorted: dicts come back with their keys in the order they had.
    return json.dumps(_encode(value), separators=(",", ":"))


def loads(text: str) -> Any:
    try:
        return _decode(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"checkpoint metadata is not valid JSON: {exc}") from None


def detach_for_save(t: torch.Tensor) -> torch.Tensor:
    # A copy, so the snapshot cannot change while it is being serialised. Copies of several tensors
    # share nothing: use snapshot_tensors for a state dict, which keeps tied tensors tied.
    return t.detach().to("cpu", copy=True).contiguous()


def snapshot_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy of every tensor (as :func:`detach_for_save`), in the same order, keeping ties.

    Names that are one tensor (weight tying: ``head.weight`` is ``embed.weight``; detected as the
    codecs do, :func:`securetrain.io.tied.shared_aliases`) get **one** copy under
    all of them, so a store writes it once (``securetrain.aliases``) and a reader hands the same
    tensor back under every name. Tensors that merely overlap get copies of their own.
    """
    aliases = shared_aliases(tensors)
    kept = {name: detach_for_save(t) for name, t in tensors.items() if name not in aliases}
    return {name: kept[aliases.get(name, name)] for name in tensors}


@contextmanager
def buffers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Leave ``model``'s buffers as they were after a look that runs its forward (a check before
    training). A forward may update buffers in eval mode too (moving averages, counters,
    quantisation observers); a look that moved them would feed training what the look saw, and a
    resumed run, which looks again after loading its checkpoint, would no longer match an
    uninterrupted one. Buffers keep their tensor objects (DDP and hooks hold them); one a forward
    replaced by a new tensor is put back."""
    saved = {name: (buf, buf.detach().clone()) for name, buf in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, (original, value) in saved.items():
                owner, _, leaf = name.rpartition(".")
                module = model.get_submodule(owner)
                original.copy_(value)
                if getattr(module, leaf, None) is not original:
                    setattr(module, leaf, original)


#: torch.compile's wrapper (``OptimizedModule``) holds the user's module as ``_orig_mod``, so its state
#: names read ``_orig_mod.0.weight`` (a compiled submodule: ``enc._orig_mod.fc.bias``).
COMPILED_SEGMENT = "_orig_mod"
_COMPILED = re.compile(r"(?:^|(?<=[./]))_orig_mod\.")
_V = TypeVar("_V")


def plain_name(name: str) -> str:
    """A state-dict name without torch.compile's ``_orig_mod`` segments (``_orig_mod.0.weight`` ->
    ``0.weight``, ``model/enc._orig_mod.fc.bias`` -> ``model/enc.fc.bias``): the name the model has
    uncompiled, which checkpoints hold."""
    return _COMPILED.sub("", name) if COMPILED_SEGMENT in name else name


def to_model_names(model_names: Iterable[str], saved: Mapping[str, _V]) -> dict[str, _V]:
    """``saved`` under the names a model has where the two differ only by ``_orig_mod`` segments: a
    checkpoint written with or without torch.compile loads into a model with or without it. Other
    names are kept (and a strict load reports them)."""
    by_plain = {plain_name(k): k for k in model_names}
    return {by_plain.get(plain_name(k), k): v for k, v in saved.items()}


def state_mismatch(current: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``saved`` does not fit a model whose ``state_dict()`` is ``current`` (names missing on
    either side, other shapes; the first few of each), or None when a strict load will take it."""
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [f"{k}: checkpoint {list(saved[k].shape)} vs model {list(v.shape)}"
              for k, v in current.items() if k in saved and saved[k].shape != v.shape]

    def listed(what: str, items: list[str]) -> str:
        more = f", ... ({len(items)} in all)" if len(items) > 3 else ""
        return f"{what} {', '.join(items[:3])}{more}"

    parts = [listed("not in the checkpoint:", missing) if missing else "",
             listed("not in the model:", unexpected) if unexpected else "",
             listed("shape of", shapes) if shapes else ""]
    return "; ".join(p for p in parts if p) or None


def load_model_state(model: torch.nn.Module, saved: Mapping[str, torch.Tensor], *, strict: bool = True) -> Any:
    """``model.load_state_dict(saved)`` accepting either form of names (see :func:`to_model_names`)."""
    return model.load_state_dict(to_model_names(model.state_dict(), saved), strict=strict)


#: ``flatten_optimizer``'s metadata layout; metadata without it is the first layout (top-level state
#: tensors under ``tensor_keys``, the rest under ``scalars``), which ``unflatten_optimizer`` still reads.
OPTIMIZER_FORMAT = 2


def flatten_optimizer(state_dict: Mapping[str, Any], prefix: str = "optim/") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer ``state_dict()`` as ``(tensors, meta)``: every tensor in it — per-parameter state,
    tensors nested in lists/tuples/dicts (LBFGS' ``old_dirs``), tensor hyper-parameters in
    ``param_groups`` (``lr=torch.tensor(1e-3)``) — becomes a host copy named by its path
    (``optim/0/exp_avg``, ``optim/0/old_dirs/2``, ``optim/param_groups/0/lr``), and ``meta`` is the
    rest of the structure with :class:`TensorRef` in their places; ``dumps(meta)`` makes it JSON.
    One tensor object that appears twice is stored once and comes back as one object. A value no
    checkpoint can hold raises :class:`UncheckpointableStateError` naming its path, before anything
    is written. :func:`unflatten_optimizer` inverts it exactly (types, dtypes, values)."""
    structure, found = _optimizer_structure(state_dict, prefix)
    _encode(structure)  # refuses what JSON cannot hold (naming the path) before any tensor is copied
    return snapshot_tensors(found), {"format": OPTIMIZER_FORMAT, "optimizer": structure}


def check_optimizer(state_dict: Mapping[str, Any]) -> None:
    """Raise :class:`UncheckpointableStateError` (naming the path) if :func:`flatten_optimizer` would:
    the same walk, without copying any tensor (cheap enough to run before training starts)."""
    _encode(_optimizer_structure(state_dict, "optim/")[0])


def _optimizer_structure(state_dict: Mapping[str, Any], prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The state dict with every tensor replaced by a :class:`TensorRef`, and those tensors by name."""
    found: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in names:
                base = prefix + (path.removeprefix("state/") if path.startswith("state/") else path)
                name, n = base, 1
                while name in found:  # keys containing "/" could meet another path
                    name, n = f"{base}~{n}", n + 1
                found[name], names[id(value)] = value, name
            return TensorRef(names[id(value)])
        if type(value) is dict:
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{path}/{i}") for i, v in enumerate(value))
        return value

    return walk(dict(state_dict), ""), found


def unflatten_optimizer(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], prefix: str = "optim/") -> dict[str, Any]:
    """The optimizer ``state_dict`` that :func:`flatten_optimizer` took apart (``meta`` as
    :func:`loads` returns it); a missing tensor is :class:`CheckpointCorruptError`."""
    if meta.get("format") == OPTIMIZER_FORMAT:
        def fill(value: Any) -> Any:
            if type(value) is TensorRef:
                if value.name not in tensors:
                    raise CheckpointCorruptError(f"checkpoint lacks optimizer tensor {value.name!r}")
                return tensors[value.name]
            if type(value) is dict:
                return {k: fill(v) for k, v in value.items()}
            if type(value) in (list, tuple):
                return type(value)(fill(v) for v in value)
            return value

        restored = fill(meta.get("optimizer"))
        if type(restored) is not dict or "state" not in restored or "param_groups" not in restored:
            raise CheckpointCorruptError("checkpoint optimizer metadata lacks 'state' or 'param_groups'")
        return restored
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

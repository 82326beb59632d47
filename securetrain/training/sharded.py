"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and its sharded checkpoints.

``training.strategy: fsdp`` shards every parameter (and the optimizer state) over the ranks on
dim 0. A checkpoint is then written by *every* rank, nobody gathers the full state:

* each rank takes its local shards from ``torch.distributed.checkpoint.state_dict.get_state_dict``
  (the DCP state-dict API: sharded DTensors) and saves them, with its own RNG state, as one
  container in its own shard store (``<checkpoints>/shards/rank-<R>/step-<N>.<ext>``; encrypted
  under the run's KEK when the store is; each shard store has its own binding id
  ``<store id>.rank<R>``, so a shard moved between ranks is refused);
* rank 0 then writes the *manifest* through the run's store (``<checkpoints>/step-<N>.<ext>``,
  the file ``latest()`` / ``list()`` see): format ``securetrain-train-sharded/1``, the world size,
  the step, every shard's file name, SHA-256 of its bytes on disk and key id, the layout of every
  tensor (sharded on dim 0 with its global shape, or replicated), and the run's training state.

Resume (same world size only, else :class:`~securetrain.training.errors.ResumeMismatchError`)
loads the manifest, then each rank loads its own shard *against the manifest's digest* and puts
it back with ``set_state_dict``. :func:`assemble_full` rebuilds the full tensors from all shards
(concatenation on dim 0 in rank order), e.g. to export or score the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from securetrain.training import state as st
from securetrain.training.checkpoint_store import CheckpointInfo
from securetrain.training.errors import CheckpointCorruptError, ResumeMismatchError, TrainingError

MANIFEST_FORMAT = "securetrain-train-sharded/1"
SHARD_FORMAT = "securetrain-train-shard/1"
SHARDS_KEY = "securetrain.train.shards"
LAYOUT_KEY = "securetrain.train.layout"
SHARD_STATE_KEY = "securetrain.train.shard"


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def shard_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The direct children that own parameters, grouped so that children sharing a parameter (tied
    weights: an output projection that is the embedding matrix) are one group; children sharing one
    with the root's own parameters are left out (the root's group holds them)."""
    root_own = {id(p) for p in model.parameters(recurse=False)}
    groups: list[tuple[list[nn.Module], set[int]]] = []
    for child in model.children():
        ids = {id(p) for p in child.parameters()}
        if not ids:
            continue
        joined = [g for g in groups if g[1] & ids]
        groups = [g for g in groups if not g[1] & ids]
        modules = [m for g in joined for m in g[0]] + [child]
        groups.append((modules, ids.union(*(g[1] for g in joined))))
    return [modules for modules, ids in groups if not ids & root_own]


def wrap_fsdp(model: nn.Module, world_size: int, device: torch.device) -> nn.Module:
    """``fully_shard`` every direct child that owns parameters, then the root (one mesh, all ranks).

    Children that share a parameter (tied weights) are sharded as one group (``fully_shard([a, b])``;
    FSDP2 refuses one parameter in two groups), so the tie holds: one sharded parameter under both
    names. Rank 0's initial weights are broadcast first, so every rank starts from the same model
    (what DDP does on construction).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if is_fsdp(model):
        return model  # the user sharded it already
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    mesh = init_device_mesh(device.type, (world_size,))
    for group in shard_groups(model):
        fully_shard(group[0] if len(group) == 1 else group, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(value: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(value, DTensor):
        placements = value.placements
        if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
            return value.to_local(), {"shard_dim": 0, "shape": list(value.shape)}
        if all(isinstance(p, Replicate) for p in placements):
            return value.to_local(), {"shard_dim": None, "shape": list(value.shape)}
        raise TrainingError(f"unsupported DTensor placement {placements} in a sharded checkpoint",
                            hint="use fully_shard on a 1-D mesh (strategy: fsdp)")
    return value, {"shard_dim": None, "shape": list(value.shape)}


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """This rank's shards as flat tensors ``model/<fqn>``, ``optim/<fqn>/<key>``; the layout; optimizer meta."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # torch types both as unions of every state value kind; ours are module/optimizer state dicts.
    msd, osd = cast(tuple[dict[str, Any], dict[str, Any]], get_state_dict(model, optimizer))
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    model_locals: dict[str, torch.Tensor] = {}
    for fqn, value in msd.items():  # names without torch.compile's "_orig_mod." (st.plain_name)
        local, lay = _local(value)
        name = f"model/{st.plain_name(fqn)}"
        model_locals[name], layout[name] = local, lay
    tensors.update(st.snapshot_tensors(model_locals))  # a tied shard (one parameter, two names) is written once
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entries in osd.get("state", {}).items():
        for key, value in entries.items():
            name = f"optim/{st.plain_name(fqn)}/{key}"
            if isinstance(value, torch.Tensor):
                local, lay = _local(value)
                tensors[name], layout[name] = st.detach_for_save(local), lay
            else:
                scalars.setdefault(st.plain_name(fqn), {})[key] = value
    return tensors, layout, {"param_groups": osd.get("param_groups", []), "scalars": scalars}


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor],
                     optim_meta: Mapping[str, Any]) -> None:
    """Put this rank's saved shards back (shapes checked against the live sharded templates)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    # templates (initialises empty optimizer state); typed as in local_state()
    msd, osd = cast(tuple[dict[str, Any], dict[str, Any]], get_state_dict(model, optimizer))
    # Saved names with or without torch.compile's "_orig_mod." (written before names were plain).
    tensors = {st.plain_name(k): v for k, v in tensors.items()}
    scalars = {st.plain_name(k): v for k, v in optim_meta.get("scalars", {}).items()}

    def fill(name: str, template: torch.Tensor) -> torch.Tensor:
        if name not in tensors:
            raise ResumeMismatchError(f"the sharded checkpoint has no {name!r}",
                                      hint="the model or optimizer differs from the run that wrote it")
        saved = tensors[name]
        local = template.to_local() if isinstance(template, DTensor) else template
        if tuple(saved.shape) != tuple(local.shape):
            raise ResumeMismatchError(f"{name}: saved shard shape {tuple(saved.shape)} != {tuple(local.shape)} here",
                                      hint="resume with the same model and world size")
        with torch.no_grad():
            local.copy_(saved)
        return template

    new_msd = {fqn: fill(f"model/{st.plain_name(fqn)}", value) for fqn, value in msd.items()}
    state: dict[str, dict[str, Any]] = {}
    for fqn, entries in osd.get("state", {}).items():
        state[fqn] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                state[fqn][key] = fill(f"optim/{st.plain_name(fqn)}/{key}", value)
            else:
                state[fqn][key] = scalars.get(st.plain_name(fqn), {}).get(key, value)
    groups = optim_meta.get("param_groups") or osd.get("param_groups", [])
    set_state_dict(model, optimizer, model_state_dict=cast(Any, new_msd),
                   optim_state_dict=cast(Any, {"state": state, "param_groups": groups}))


def manifest_metadata(shards: list[CheckpointInfo], base: Path, world_size: int, layout: Mapping[str, Any]) -> dict[str, str]:
    entries = []
    for rank, info in enumerate(shards):
        try:
            name = str(info.path.relative_to(base))
        except ValueError:
            name = str(info.path)
        entries.append({"rank": rank, "file": name, "step": info.step, "sha256": info.sha256, "key_id": info.key_id})
    return {SHARDS_KEY: json.dumps({"world_size": world_size, "shards": entries}, sort_keys=True),
            LAYOUT_KEY: json.dumps(layout, sort_keys=True)}


def shard_infos(metadata: Mapping[str, str], base: Path) -> tuple[int, list[CheckpointInfo]]:
    """``(world_size, [CheckpointInfo per rank])`` from a manifest's metadata."""
    try:
        doc = json.loads(metadata[SHARDS_KEY])
        infos = []
        for rank, entry in enumerate(doc["shards"]):
            if int(entry["rank"]) != rank:
                raise ValueError("shards out of order")
            path = Path(entry["file"])
            if path.is_absolute() or ".." in path.parts:
                raise ValueError("shard path escapes the store")
            infos.append(CheckpointInfo(base / path, int(entry["step"]), str(entry["sha256"]), entry.get("key_id")))
        world = int(doc["world_size"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointCorruptError(f"malformed sharded-checkpoint manifest ({type(exc).__name__}: {exc})",
                                     hint="the manifest is authenticated: this is a writer bug or tampering") from None
    if world != len(infos):
        raise CheckpointCorruptError(f"manifest names {len(infos)} shards for world size {world}")
    return world, infos


def shard_store(store: Any, rank: int) -> Any:
    maker = getattr(store, "shard_store", None)
    if not callable(maker):
        raise TrainingError(f"{type(store).__name__} cannot hold FSDP shards (no shard_store(rank))",
                            hint="use EncryptedCheckpointStore or SafetensorsCheckpointStore, or strategy: ddp")
    return maker(rank)


def assemble_full(store: Any, manifest: Any) -> dict[str, torch.Tensor]:
    """Full ``model/*`` tensors from every rank's shard of ``manifest`` (each verified against its digest)."""
    _, infos = shard_infos(manifest.metadata, Path(store.directory))
    layout = json.loads(manifest.metadata[LAYOUT_KEY])
    parts: dict[str, list[torch.Tensor]] = {}
    for rank, info in enumerate(infos):
        loaded = shard_store(store, rank).load(info)
        for name, tensor in loaded.tensors.items():
            if name.startswith("model/"):
                parts.setdefault(name, []).append(tensor)
    full: dict[str, torch.Tensor] = {}
    for name, pieces in parts.items():
        lay = layout.get(name, {"shard_dim": None})
        tensor = torch.cat(pieces, dim=0) if lay.get("shard_dim") == 0 else pieces[0]
        if list(tensor.shape) != list(lay.get("shape", tensor.shape)):
            raise CheckpointCorruptError(f"{name}: assembled shape {list(tensor.shape)} != manifest {lay.get('shape')}")
        full[name] = tensor
    return full

"""The default checkpoint store: plain safetensors files, one per step, written atomically.

Layout: ``<directory>/step-00000042.safetensors``. safetensors never executes code on load (no
pickle), and every write goes through :func:`securetrain.io.atomic.atomic_writer`, so a crash leaves
the previous checkpoint intact. This store gives integrity against accidents (digest check on load
when the caller passes a :class:`CheckpointInfo`), not against an attacker who can rewrite files:
use the encrypted store for that.

Tied tensors (several names over one tensor, e.g. ``lm_head.weight = embed.weight``) are written
once, under the first name in sorted order, with the others recorded in the metadata key
``securetrain.aliases`` (:mod:`securetrain.io.tied`, the encrypted container's convention too),
and ``load`` hands the same tensor object back under every name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.io.atomic import atomic_write_bytes
from securetrain.io.tied import ALIASES_KEY, aliases_json, restore_aliases, shared_aliases
from securetrain.training.checkpoint_store import CheckpointInfo, LoadedCheckpoint
from securetrain.training.errors import CheckpointCorruptError, CheckpointNotFoundError

_NAME = re.compile(r"^step-(\d{8,})\.safetensors$")
STEP_KEY = "securetrain.step"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.safetensors"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SafetensorsCheckpointStore:
    """``CheckpointStore`` over a directory of plain safetensors files."""

    def __init__(
        self, directory: str | os.PathLike[str], *, keep_last: int | None = None, audit: AuditRecorder | None = None
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 or None")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.audit: AuditRecorder = audit or NullAuditRecorder()

    def shard_store(self, rank: int) -> SafetensorsCheckpointStore:
        """The store of rank ``rank``'s FSDP shards (``shards/rank-<R>/``)."""
        return SafetensorsCheckpointStore(self.directory / "shards" / f"rank-{int(rank):05d}",
                                          keep_last=None if self.keep_last is None else self.keep_last + 1,
                                          audit=self.audit)

    def _paths(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> CheckpointInfo:
        if step < 0:
            raise ValueError("step must be >= 0")
        meta = {str(k): str(v) for k, v in metadata.items()}
        if ALIASES_KEY in meta:
            raise ValueError(f"metadata key {ALIASES_KEY!r} is reserved (the store records tied tensors in it)")
        meta[STEP_KEY] = str(step)
        # safetensors refuses shared storage: write each tied tensor once and record its other names.
        aliases = shared_aliases(tensors)
        if aliases:
            meta[ALIASES_KEY] = aliases_json(aliases)
        data = st_save({k: v for k, v in tensors.items() if k not in aliases}, metadata=meta)
        path = self.directory / checkpoint_name(step)
        atomic_write_bytes(path, data)
        info = CheckpointInfo(path=path, step=step, sha256=_sha256(data))
        self.audit.record("checkpoint.write", path.name, details={"step": step, "sha256": info.sha256, "key_id": None})
        self._prune()
        return info

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        paths = self._paths()
        for _, old in paths[: max(0, len(paths) - self.keep_last)]:
            old.unlink(missing_ok=True)

    def _info(self, step: int, path: Path) -> CheckpointInfo:
        return CheckpointInfo(path=path, step=step, sha256=_sha256(path.read_bytes()))

    def list(self) -> list[CheckpointInfo]:
        return [self._info(step, path) for step, path in self._paths()]

    def latest(self) -> CheckpointInfo | None:
        paths = self._paths()
        return self._info(*paths[-1]) if paths else None

    def load(self, info: CheckpointInfo | None = None) -> LoadedCheckpoint:
        if info is None:
            paths = self._paths()
            if not paths:
                raise CheckpointNotFoundError(
                    f"no checkpoint in {self.directory}", hint="train first or point to the right output directory"
                )
            step, path = paths[-1]
            expected = None
        else:
            step, path, expected = info.step, Path(info.path), info.sha256
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist") from None
        digest = _sha256(data)
        if expected is not None and digest != expected:
            raise CheckpointCorruptError(
                f"checkpoint {path.name} changed on disk: sha256 {digest[:16]}… != recorded {expected[:16]}…",
                hint="the file was modified or replaced after it was written; restore it from a trusted copy",
            )
        try:
            tensors, meta = restore_aliases(st_load(data), _read_metadata(data))
        except (SafetensorError, ValueError, OSError, RuntimeError) as exc:
            raise CheckpointCorruptError(
                f"checkpoint {path.name} is not a valid safetensors file ({type(exc).__name__})",
                hint="it may be truncated by a full disk or tampered with; use an older checkpoint",
            ) from None
        if meta.get(STEP_KEY) != str(step):
            raise CheckpointCorruptError(
                f"checkpoint {path.name} claims step {meta.get(STEP_KEY)!r}, expected {step}",
                hint="files were renamed or swapped",
            )
        return LoadedCheckpoint(info=CheckpointInfo(path=path, step=step, sha256=digest), tensors=tensors, metadata=meta)


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (header = u64 length + JSON)."""
    if len(data) < 8:
        raise ValueError("file shorter than the safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ValueError("header length exceeds file size")
    header = json.loads(data[8 : 8 + length])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError("metadata is not a string mapping")
    return meta

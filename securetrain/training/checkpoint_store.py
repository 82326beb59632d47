"""The single interface through which the training engine persists checkpoints.

The engine hands a store a flat ``{name: tensor}`` mapping plus string metadata (exactly the
safetensors data model, so nothing ever needs pickle). Stores decide the bytes on disk:
:class:`securetrain.training.safetensors_store.SafetensorsCheckpointStore` writes plain safetensors;
``securetrain.crypto.checkpoint.EncryptedCheckpointStore`` wraps the same payload in the AEAD
container. Every store writes atomically, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a checkpoint went and what identifies it (safe to log: no key material)."""

    path: Path
    step: int
    sha256: str  # digest of the bytes on disk
    key_id: str | None = None  # set by encrypting stores


@dataclass
class LoadedCheckpoint:
    info: CheckpointInfo
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class CheckpointStore(Protocol):
    def save(
        self, step: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
    ) -> CheckpointInfo:
        """Persist one checkpoint atomically and return where it went."""
        ...

    def load(self, info: CheckpointInfo | None = None) -> LoadedCheckpoint:
        """Load ``info`` (default: the latest); raise a SecureTrainError subclass if none/invalid."""
        ...

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint with the highest step, or ``None`` when the store is empty."""
        ...

    def list(self) -> list[CheckpointInfo]:
        """All checkpoints, oldest step first."""
        ...

"""SHA-256 over named tensors (name, then raw bytes, by name): how the training tests compare
weights bit for bit across ranks, runs and resumes. Imported by the test modules and by the worker
scripts torchrun starts from this folder."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def digest_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def digest(model: torch.nn.Module) -> str:
    """:func:`digest_tensors` of ``model.state_dict()``."""
    return digest_tensors(model.state_dict())

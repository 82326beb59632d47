"""Deterministic seeding and exact RNG capture/restore (torch CPU + accelerator, numpy, random)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

# Mixes the epoch into the shuffle seed so every epoch gets a different, reproducible order.
_EPOCH_MIX = 0x9E3779B1


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed: int, epoch: int) -> int:
    return (seed * _EPOCH_MIX + epoch) % 2**63


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (splitmix64 of the three), for per-sample augmentation."""
    z = (epoch_seed(seed, epoch) * 0x100000001B3 + index + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % 2**63


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed torch, numpy and random for one sample (in a DataLoader worker: its RNG is its own)."""
    s = sample_seed(seed, epoch, index)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def worker_init_fn(worker_id: int) -> None:
    """DataLoader workers: derive numpy/random seeds from torch's per-worker seed (itself drawn from
    the loader's seeded generator), so augmentation randomness is reproducible and differs per worker."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def capture_rng_state(device_type: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """RNG state as tensors + JSON-able values (the safetensors data model, no pickle)."""
    tensors: dict[str, torch.Tensor] = {"torch_cpu": torch.get_rng_state().clone()}
    if device_type == "cuda" and torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state.clone()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy())
    version, py_state, py_gauss = random.getstate()
    meta = {
        "numpy": {"kind": np_kind, "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }
    return tensors, meta


def restore_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any], device_type: str) -> None:
    torch.set_rng_state(tensors["torch_cpu"].to(torch.uint8))
    if device_type == "cuda" and torch.cuda.is_available():
        states = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
        if states:
            torch.cuda.set_rng_state_all(states)
    np_meta = meta["numpy"]
    np.random.set_state(
        (np_meta["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), np_meta["pos"], np_meta["has_gauss"], np_meta["gauss"])
    )
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


@contextmanager
def eval_look(model: torch.nn.Module, device_type: str) -> Iterator[None]:
    """A look at ``model`` before training (a check that runs its forward): eval mode inside; after,
    its train/eval mode and every RNG stream (torch, accelerator, NumPy, Python) as they were, so the
    look leaves training unchanged."""
    was_training = model.training
    rng_t, rng_m = capture_rng_state(device_type)
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        restore_rng_state(rng_t, rng_m, device_type)

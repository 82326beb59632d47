"""Two-process DDP on CPU (gloo) via torchrun: ranks end identical, only rank 0 writes, exact resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from securetrain.training import SafetensorsCheckpointStore
from securetrain.training.synthetic import make_mlp

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.mark.slow
def test_torchrun_two_ranks_identical_weights_and_exact_resume(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(WORKER), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    full = [(tmp_path / "full" / f"rank{r}.sha256").read_text().split() for r in (0, 1)]
    # 100 samples -> 50 per rank -> 7 micro-batches -> 4 steps per epoch (last window short) -> 8 steps
    assert full[0] == full[1] and full[0][1:] == ["8", "completed"]
    resumed = [(tmp_path / "resumed" / f"rank{r}.sha256").read_text().split() for r in (0, 1)]
    assert resumed[0] == resumed[1] == full[0]  # stopped at step 3 (mid-epoch), resumed: bit-identical

    store = SafetensorsCheckpointStore(tmp_path / "full" / "checkpoints")
    assert [i.step for i in store.list()] == [4, 8]  # checkpoint_every=4; final step not written twice
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == [
        "step-00000004.safetensors", "step-00000008.safetensors",
    ]  # no stray temp files from a second writer
    ckpt = store.load()
    weights = {k.removeprefix("model/"): v for k, v in ckpt.tensors.items() if k.startswith("model/")}
    assert not any(k.startswith("module.") for k in weights)  # saved unwrapped, loadable without DDP
    assert {k for k in ckpt.tensors if k.startswith("rng/")} >= {"rng/0/torch_cpu", "rng/1/torch_cpu"}
    init = make_mlp(10, 3, hidden=16, dropout=0.1, seed=0).state_dict()
    assert any(not torch.equal(init[k], weights[k]) for k in init)  # it trained
    resumed_steps = [i.step for i in SafetensorsCheckpointStore(tmp_path / "resumed" / "checkpoints").list()]
    assert resumed_steps == [3, 4, 8]


@pytest.mark.slow
def test_torchrun_model_with_unused_parameters(tmp_path: Path) -> None:
    """A user's model with a parameter the loss does not use cannot train under plain DDP: a
    TrainingError names training.find_unused_parameters (it was torch's RuntimeError telling the
    user to pass a DDP argument the Trainer does not expose), and with the setting it trains."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = Path(__file__).with_name("ddp_unused_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(worker), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        # 32 samples -> 16 per rank -> 4 steps
        assert (tmp_path / f"rank{rank}.txt").read_text().split("\n")[:2] == ["TrainingError True", "completed 4"]

"""Two-process DDP on CPU (gloo) via torchrun: ranks end identical, only rank 0 writes, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from two_ranks import run_two_ranks

from securetrain.training import SafetensorsCheckpointStore
from securetrain.training.synthetic import make_mlp

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.mark.slow
def test_torchrun_two_ranks_identical_weights_and_exact_resume(tmp_path: Path) -> None:
    run_two_ranks(WORKER, tmp_path)
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
    run_two_ranks(Path(__file__).with_name("ddp_unused_worker.py"), tmp_path)
    for rank in (0, 1):
        # 32 samples -> 16 per rank -> 4 steps
        assert (tmp_path / f"rank{rank}.txt").read_text().split("\n")[:2] == ["TrainingError True", "completed 4"]


@pytest.mark.slow
def test_torchrun_custom_samplers_are_split_between_ranks(tmp_path: Path) -> None:
    """A DataLoader's sampler (or batch sampler) of the user's own kind was used as is under DDP: every
    rank read every sample. Now the ranks split the sampler's order (each takes every second item),
    drawn alike on both ranks (global RNGs seeded by (seed, epoch)), resumably; a sampler that shards
    itself is kept, and one that draws another order on each rank is refused."""
    from ddp_sampler_worker import ByLabel, N

    run_two_ranks(Path(__file__).with_name("ddp_sampler_worker.py"), tmp_path)

    def ranks(run: str) -> list[dict]:
        return [json.loads((tmp_path / run / f"rank{r}.json").read_text()) for r in (0, 1)]

    evens = set(range(0, N, 2))
    full = ranks("sampler")
    assert [(r["steps"], r["reason"]) for r in full] == [(8, "completed")] * 2  # 40 / 2 ranks / 5 = 4 steps per epoch
    assert full[0]["digest"] == full[1]["digest"]
    for epoch in (0, 1):
        a, b = (r["read"][20 * epoch : 20 * (epoch + 1)] for r in full)
        assert not set(a) & set(b) and set(a) | set(b) == evens, epoch  # split, nothing read twice
    assert full[0]["read"][:20] != full[0]["read"][20:]  # another order per epoch
    resumed = ranks("resumed")
    assert [r["digest"] for r in resumed] == [full[0]["digest"]] * 2  # stopped at step 3, resumed: bit-identical

    batches = ranks("batches")
    assert batches[0]["digest"] == batches[1]["digest"] and batches[0]["steps"] == batches[1]["steps"]
    for rank, record in enumerate(batches):
        expected: list[int] = []
        for epoch in (0, 1):
            sampler = ByLabel()
            sampler.set_epoch(epoch)
            order = list(sampler)
            order += order[: len(order) % 2]  # padded by wrapping to a multiple of 2
            expected += [i for batch in order[rank::2] for i in batch]
        assert record["read"] == expected, rank

    sharded = ranks("sharded")
    assert [set(r["read"]) for r in sharded] == [set(range(0, N, 2)), set(range(1, N, 2))]

    for record in ranks("unseeded"):
        assert record["error"] == "TrainingError" and "different order on each" in record["message"]
        assert record["read"] == []

"""Backend advice applied by the trainer (batch multiple, loader workers) and the stop-flag cadence."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from securetrain.devices import CpuBackend
from securetrain.training import Trainer, TrainingConfig
from securetrain.training.distributed import DistContext
from securetrain.training.synthetic import SyntheticClassification, make_mlp

torch.set_num_threads(1)


class Multiple8(CpuBackend):
    batch_multiple = 8


def _fit(tmp: Path, backend=None, **kw):  # noqa: ANN001, ANN003
    cfg = TrainingConfig(**({"epochs": 1, "batch_size": 5, "output_dir": tmp, "checkpoint_at_end": False} | kw))
    trainer = Trainer(make_mlp(8, 3, hidden=8, seed=0), SyntheticClassification(samples=40, features=8, classes=3),
                      cfg, backend=backend or CpuBackend())
    return trainer, trainer.fit()


def test_batch_size_rounded_to_the_backend_multiple_and_logged(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="securetrain.training"):
        trainer, result = _fit(tmp_path / "a", Multiple8())
    assert trainer.batch_size == 8 and result.steps == 5  # 40 samples / 8
    assert "batch_size 5 rounded up to 8" in caplog.text
    trainer, result = _fit(tmp_path / "b", Multiple8(), batch_multiple="off")
    assert trainer.batch_size == 5 and result.steps == 8
    trainer, _ = _fit(tmp_path / "c")  # CPU: multiple 1, nothing logged, no loader workers advised
    assert trainer.batch_size == 5 and trainer.num_workers == 0


def test_explicit_num_workers_wins_over_the_advice(tmp_path: Path) -> None:
    class Advising(CpuBackend):
        def loader_workers(self, procs_per_node: int = 1) -> int:
            return 1

    trainer, _ = _fit(tmp_path / "a", Advising(), max_steps=1)
    assert trainer.num_workers == 1
    trainer, _ = _fit(tmp_path / "b", Advising(), num_workers=0, max_steps=1)
    assert trainer.num_workers == 0


class CountingDist(DistContext):
    """A 2-rank context whose all-reduce is counted (and sees the flag of 'another rank')."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=2)
        self.reductions: list[int] = []
        self.remote_flag = False
        self.step_of: object = None

    def any_flag(self, flag: bool) -> bool:
        self.reductions.append(self.step_of.progress.step)  # type: ignore[attr-defined]
        return flag or self.remote_flag


@pytest.mark.parametrize("every, expected", [(1, list(range(1, 11))), (4, [4, 6, 8, 10])])
def test_stop_flag_is_reduced_every_n_steps_at_checkpoints_and_the_end(tmp_path: Path, every, expected) -> None:
    trainer = Trainer(make_mlp(8, 3, hidden=8, seed=0), SyntheticClassification(samples=80, features=8, classes=3),
                      TrainingConfig(epochs=1, batch_size=8, stop_check_every=every, checkpoint_every=6,
                                     output_dir=tmp_path), backend=CpuBackend())
    dist = CountingDist()
    dist.step_of = trainer
    trainer.dist = dist
    trainer._total_steps = 10
    for step in range(1, 11):
        trainer.progress.step = step
        ckpt = step % 6 == 0
        assert trainer._stop_check_due(ckpt) is False
    assert dist.reductions == expected  # not a host sync every step
    dist.remote_flag = True  # another rank was preempted: this one stops at the next check, not before
    trainer.progress.step = 11
    assert trainer._stop_check_due(False) is (every == 1)
    trainer.progress.step = 12
    assert trainer._stop_check_due(False) is True


def test_profile_writes_a_chrome_trace_and_the_result_carries_memory(tmp_path: Path) -> None:
    import json

    trainer, result = _fit(tmp_path, profile={"steps": 2, "wait": 1})
    assert result.profile_trace == tmp_path / "profile" / "trace-rank0.json"
    trace = json.loads(result.profile_trace.read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("ProfilerStep#2" in n for n in names) and any(n.startswith("aten::") for n in names)
    assert not any("ProfilerStep#0" in n for n in names)  # the wait step is not recorded
    assert result.memory.get("process_rss", 0) > 0
    _, plain = _fit(tmp_path / "plain")
    assert plain.profile_trace is None and not (tmp_path / "plain" / "profile").exists()

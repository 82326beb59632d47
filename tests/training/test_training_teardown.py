"""Process-group teardown: every rank, every path; the teardown barrier only after a normal end.

Why (tests/pipeline/test_pipeline_torchrun.py's FSDP run once aborted a rank at exit with
"terminate called without an active exception"): a process that exits with gloo's threads still
running can abort in them, so the group is destroyed on every path; a rank that ended normally
first waits (bounded) for the others, and after an error nobody waits for a peer that may be dead.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import securetrain.training.distributed as distributed
import securetrain.training.trainer as trainer_module
from securetrain.devices import CpuBackend
from securetrain.training import Trainer, TrainingConfig, TrainingError
from securetrain.training.distributed import DistContext
from securetrain.training.synthetic import SyntheticClassification, make_mlp

torch.set_num_threads(1)


class FakeWork:
    def __init__(self, result: bool = True, error: BaseException | None = None) -> None:
        self.result, self.error, self.timeout = result, error, None

    def wait(self, timeout: timedelta) -> bool:
        self.timeout = timeout
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> dict:
    """torch.distributed as seen by DistContext: an initialised 2-rank group, calls recorded."""
    state: dict = {"initialized": True, "work": FakeWork(), "calls": []}

    def barrier(async_op: bool = False) -> FakeWork:
        state["calls"].append(("barrier", async_op))
        return state["work"]

    def destroy() -> None:
        state["calls"].append(("destroy",))
        state["initialized"] = False

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(distributed.dist, "barrier", barrier)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", destroy)
    return state


def _owner() -> DistContext:
    return DistContext(rank=1, world_size=2, owns_group=True)


def test_a_normal_end_waits_for_every_rank_then_destroys_once(fake_dist: dict) -> None:
    ctx = _owner()
    ctx.close()
    assert fake_dist["calls"] == [("barrier", True), ("destroy",)]
    assert fake_dist["work"].timeout == timedelta(seconds=distributed.TEARDOWN_TIMEOUT_S)  # bounded, not 30 min
    ctx.close()  # idempotent
    assert fake_dist["calls"] == [("barrier", True), ("destroy",)]


def test_after_an_error_the_group_is_destroyed_without_waiting_for_peers(fake_dist: dict) -> None:
    _owner().close(clean=False)
    assert fake_dist["calls"] == [("destroy",)]


@pytest.mark.parametrize("work", [FakeWork(result=False), FakeWork(error=RuntimeError("Connection closed by peer"))])
def test_a_failed_or_timed_out_barrier_still_destroys(fake_dist: dict, work: FakeWork,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    fake_dist["work"] = work
    with caplog.at_level(logging.WARNING, logger="securetrain.training.distributed"):
        _owner().close()
    assert fake_dist["calls"] == [("barrier", True), ("destroy",)]
    assert "teardown barrier failed" in caplog.text and "destroying the process group anyway" in caplog.text


def test_an_interrupt_during_the_barrier_still_destroys(fake_dist: dict) -> None:
    fake_dist["work"] = FakeWork(error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _owner().close()
    assert fake_dist["calls"] == [("barrier", True), ("destroy",)]


def test_a_group_we_did_not_create_is_left_alone(fake_dist: dict) -> None:
    DistContext(rank=0, world_size=2, owns_group=False).close()
    assert fake_dist["calls"] == []


# -- the trainer closes the group on every path ------------------------------------------------------
class Recording(DistContext):
    closed: list[bool] = []

    def close(self, *, clean: bool = True) -> None:
        Recording.closed.append(clean)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    Recording.closed = []
    monkeypatch.setattr(trainer_module, "init_distributed", lambda backend: Recording())
    return Recording.closed


def _trainer(tmp: Path, backend: CpuBackend | None = None, **kw) -> Trainer:  # noqa: ANN003
    cfg = TrainingConfig(epochs=1, batch_size=8, output_dir=tmp, checkpoint_at_end=False)
    return Trainer(make_mlp(8, 3, hidden=8, seed=0), SyntheticClassification(samples=32, features=8, classes=3),
                   cfg, backend=backend or CpuBackend(), **kw)


def test_trainer_closes_cleanly_after_a_normal_run(tmp_path: Path, recorded: list[bool]) -> None:
    _trainer(tmp_path).fit()
    assert recorded == [True]


def test_trainer_closes_without_the_barrier_when_training_fails(tmp_path: Path, recorded: list[bool]) -> None:
    def nan_loss(model, batch):  # noqa: ANN001
        return model(batch[0]).sum() * float("nan")

    with pytest.raises(TrainingError, match="non-finite"):
        _trainer(tmp_path, loss_fn=nan_loss).fit()
    assert recorded == [False]


def test_trainer_closes_when_the_device_setup_fails(tmp_path: Path, recorded: list[bool]) -> None:
    class Broken(CpuBackend):
        def device(self) -> torch.device:
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        _trainer(tmp_path, Broken()).fit()
    assert recorded == [False]  # before the change the group created just before leaked here

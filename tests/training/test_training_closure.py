"""Optimizers that need a closure (LBFGS, or any ``step(closure)``) are driven by the Trainer: the
closure recomputes the loss (and gradients) over the step's whole accumulation window, the run is
deterministic and resumes bit-identically; fp16's GradScaler (which cannot step with a closure) is
refused with a typed error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from securetrain.training import StepMetrics, Trainer, TrainerCallback, TrainingConfig, TrainingError
from securetrain.training.synthetic import SyntheticClassification, make_mlp
from securetrain.training.trainer import optimizer_needs_closure

torch.set_num_threads(1)


def _data() -> SyntheticClassification:
    return SyntheticClassification(samples=48, features=8, classes=3, seed=2)


def _cfg(tmp: Path, **kw: Any) -> TrainingConfig:
    base: dict[str, Any] = dict(epochs=2, batch_size=8, grad_accumulation=2, seed=4, output_dir=tmp, log_every=1,
                                device="cpu")
    return TrainingConfig(**(base | kw))


def _lbfgs(params: Any) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(params, lr=0.5, history_size=3, max_iter=3)


class ClosureOnly(torch.optim.SGD):
    """A user optimizer whose step requires a closure (calls it twice, like SAM)."""

    def step(self, closure):  # type: ignore[override]  # noqa: ANN001, ANN201
        with torch.enable_grad():
            closure()
            loss = closure()
        super().step()
        return loss


def test_needs_closure_is_read_from_the_signature() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    assert optimizer_needs_closure(torch.optim.LBFGS(p))
    assert optimizer_needs_closure(ClosureOnly(p, lr=0.1))
    assert not optimizer_needs_closure(torch.optim.AdamW(p))
    assert not optimizer_needs_closure(torch.optim.SGD(p, lr=0.1))


def test_lbfgs_trains_and_lowers_the_loss(tmp_path: Path) -> None:
    model = make_mlp(8, 3, hidden=8, seed=1)
    result = Trainer(model, _data(), _cfg(tmp_path, grad_clip=None, epochs=3), optimizer=_lbfgs).fit()
    assert result.reason == "completed" and result.steps == 9
    assert result.final_loss is not None and result.final_loss < 0.9


class _StopAt(TrainerCallback):
    """Preempt after ``step`` optimizer steps (what SIGTERM does), keeping the run's config."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if metrics.step == self.step:
            trainer.request_stop()


def test_lbfgs_resume_is_bit_identical(tmp_path: Path) -> None:
    """Dropout, accumulation, clipping and a scheduler, interrupted mid-epoch: same weights as one run."""
    sched = {"name": "cosine"}
    ref = make_mlp(8, 3, hidden=8, dropout=0.2, seed=1)
    Trainer(ref, _data(), _cfg(tmp_path / "ref", scheduler=sched), optimizer=_lbfgs).fit()

    first = Trainer(make_mlp(8, 3, hidden=8, dropout=0.2, seed=1), _data(),
                    _cfg(tmp_path / "run", scheduler=sched), optimizer=_lbfgs, callbacks=[_StopAt(2)]).fit()
    assert first.steps == 2 and first.reason == "preempted"
    fresh = make_mlp(8, 3, hidden=8, dropout=0.2, seed=7)
    torch.manual_seed(999)
    second = Trainer(fresh, _data(), _cfg(tmp_path / "run", scheduler=sched), optimizer=_lbfgs).fit()
    assert second.resumed_from == 2 and second.steps == 6
    for k, v in ref.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def test_closure_step_equals_the_plain_step_for_sgd(tmp_path: Path) -> None:
    """TrainingConfig(closure=True) on an optimizer that takes an optional closure (SGD) does the
    same math as the plain step: accumulation and clipping happen inside the closure."""
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    plain = make_mlp(8, 3, hidden=8, seed=1)
    Trainer(plain, _data(), _cfg(tmp_path / "plain", grad_clip=0.5), optimizer=sgd).fit()
    closed = make_mlp(8, 3, hidden=8, seed=1)
    result = Trainer(closed, _data(), _cfg(tmp_path / "closed", grad_clip=0.5, closure=True), optimizer=sgd).fit()
    assert result.steps == 6
    for k, v in plain.state_dict().items():
        assert torch.equal(v, closed.state_dict()[k]), k


def test_a_user_optimizer_that_requires_a_closure_runs(tmp_path: Path) -> None:
    model = make_mlp(8, 3, hidden=8, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = Trainer(model, _data(), _cfg(tmp_path, max_steps=2),
                     optimizer=lambda p: ClosureOnly(p, lr=0.1)).fit()
    assert result.steps == 2
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_fp16_with_a_closure_optimizer_is_refused(tmp_path: Path) -> None:
    trainer = Trainer(make_mlp(8, 3, hidden=8, seed=1), _data(), _cfg(tmp_path, precision="fp16"), optimizer=_lbfgs)
    with pytest.raises(TrainingError, match="closure") as info:
        trainer.fit()
    assert "bf16" in str(info.value)


@pytest.mark.slow
def test_lbfgs_under_ddp_ranks_agree_and_resume_exactly(tmp_path: Path) -> None:
    from two_ranks import run_two_ranks

    run_two_ranks(Path(__file__).with_name("ddp_closure_worker.py"), tmp_path, timeout=300)
    full = [(tmp_path / "full" / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert full[0] == full[1] and full[0][1:] == ["4", "completed"]  # 32 per rank, 4 micro-batches, accum 2
    first = [(tmp_path / "resumed" / f"first{r}.txt").read_text().split() for r in (0, 1)]
    assert [f[1:] for f in first] == [["2", "preempted"]] * 2
    resumed = [(tmp_path / "resumed" / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert resumed[0] == resumed[1] == full[0]


def test_auto_precision_falls_back_to_fp32_where_it_would_be_fp16(tmp_path: Path) -> None:
    """On a backend whose auto precision is fp16 (older GPUs), a closure optimizer trains in fp32."""
    from securetrain.devices.builtin import CpuBackend

    class Fp16Cpu(CpuBackend):
        @property
        def autocast_dtype(self) -> torch.dtype | None:
            return torch.float16

    result = Trainer(make_mlp(8, 3, hidden=8, seed=1), _data(), _cfg(tmp_path, precision="auto", max_steps=2),
                     optimizer=_lbfgs, backend=Fp16Cpu()).fit()
    assert result.precision == "fp32" and result.steps == 2

"""Validation every epoch, best checkpoint, early stopping, LR schedulers — and exact resume of all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from securetrain.training import MetricsHistory, SafetensorsCheckpointStore, Trainer, TrainingConfig, TrainingError
from securetrain.training import state as st
from securetrain.training.config import SchedulerConfig
from securetrain.training.errors import ResumeMismatchError
from securetrain.training.schedulers import build_scheduler
from securetrain.training.synthetic import SyntheticClassification, make_mlp
from securetrain.training.validation import BestTracker, binary_auc, classification_metrics, macro_auc

torch.set_num_threads(1)


def _cfg(tmp: Path, **kw) -> TrainingConfig:  # noqa: ANN003
    base = dict(epochs=4, batch_size=8, lr=5e-3, seed=4, output_dir=tmp, log_every=1)
    return TrainingConfig.model_validate(base | kw)


def _train() -> SyntheticClassification:
    return SyntheticClassification(samples=64, features=8, classes=3, seed=2)


def _eval() -> SyntheticClassification:
    return SyntheticClassification(samples=30, features=8, classes=3, seed=7)


def test_auc_matches_sklearn_including_ties() -> None:
    sklearn = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 200)
    p = np.round(rng.random((200, 3)), 1)  # many ties
    p /= p.sum(1, keepdims=True) + 1e-9
    assert macro_auc(p, y) == pytest.approx(sklearn.roc_auc_score(y, p, multi_class="ovr", average="macro"), abs=1e-12)
    s = np.round(rng.random(100), 1)
    b = rng.random(100) < 0.3
    assert binary_auc(s, b) == pytest.approx(sklearn.roc_auc_score(b, s), abs=1e-12)
    assert binary_auc(s, np.zeros(100, bool)) is None  # one class only: undefined, not 0.5


def test_binary_auc_takes_integer_labels_as_a_mask_not_as_indices() -> None:
    scores = np.array([0.1, 0.2, 0.8, 0.9])
    assert binary_auc(scores, np.array([0, 0, 1, 1])) == 1.0  # was 0.75: ranks[[0, 0, 1, 1]]
    assert binary_auc(scores[::-1].copy(), np.array([0, 0, 1, 1])) == 0.0
    assert binary_auc(scores, np.array([0, 0, 1, 1], dtype=bool)) == 1.0


def test_classification_metrics_counts_and_confusion() -> None:
    logits = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 3.0, 0], [0, 0, 3.0]])
    targets = torch.tensor([0, 1, 2, 2])
    m = classification_metrics(logits, targets)
    assert m["accuracy"] == 0.75 and m["class_counts"] == [1, 1, 2] and m["predicted_counts"] == [1, 2, 1]
    assert m["confusion"] == [[1, 0, 0], [0, 1, 0], [0, 1, 1]] and m["samples"] == 4
    assert 0 < m["loss"] < 1 and m["auc"] is not None


def test_validation_every_epoch_and_best_checkpoint(tmp_path: Path) -> None:
    hist = MetricsHistory()
    best_store = SafetensorsCheckpointStore(tmp_path / "best", keep_last=1)
    cfg = _cfg(tmp_path / "run", validation={"metric": "accuracy"})
    r = Trainer(make_mlp(8, 3, seed=1), _train(), cfg, eval_data=_eval(), best_store=best_store, callbacks=[hist]).fit()
    assert [v["epoch"] for v in r.validation] == [1, 2, 3, 4] and len(hist.validations) == 4
    assert all({"loss", "accuracy", "auc", "class_counts", "confusion"} <= set(v) for v in r.validation)
    assert sum(r.validation[0]["class_counts"]) == 30
    best = max(r.validation, key=lambda v: v["accuracy"])  # first of the maxima wins (strict improvement)
    assert r.best["metric"] == "accuracy" and r.best["value"] == best["accuracy"] and r.best["epoch"] == best["epoch"]
    saved = best_store.load()
    assert saved.info.step == best["step"] and str(saved.info.path) == r.best["checkpoint"]
    assert set(saved.tensors) == {f"model/{k}" for k in make_mlp(8, 3, seed=1).state_dict()}


def test_early_stopping_after_patience(tmp_path: Path) -> None:
    # lr 0 => the metric never improves after the first validation => stop after 1 + patience epochs.
    cfg = _cfg(tmp_path, epochs=10, lr=1e-12, validation={"metric": "loss", "patience": 2, "min_delta": 1.0})
    r = Trainer(make_mlp(8, 3, seed=1), _train(), cfg, eval_data=_eval()).fit()
    assert r.reason == "early_stopped" and r.epoch == 3 and len(r.validation) == 3 and r.exit_code == 0
    # Rerunning resumes the stopped run and does not train further.
    again = Trainer(make_mlp(8, 3, seed=1), _train(), cfg, eval_data=_eval()).fit()
    assert again.reason == "early_stopped" and again.steps == r.steps and len(again.validation) == 3


@pytest.mark.parametrize("scheduler", [
    {"name": "cosine", "warmup_steps": 3},
    {"name": "step", "step_epochs": 1, "gamma": 0.5, "warmup_epochs": 0.5},
    {"name": "onecycle", "warmup_steps": 4},
])
def test_resume_with_scheduler_and_validation_is_bit_identical(tmp_path: Path, scheduler: dict) -> None:
    from securetrain.training import TrainerCallback

    class InterruptAt(TrainerCallback):  # what SIGTERM does: stop after this optimizer step
        def on_step(self, trainer, metrics):  # noqa: ANN001
            if metrics.step == 13:
                trainer.request_stop()

    def run(out: Path, model: torch.nn.Module, *extra: TrainerCallback) -> object:
        cfg = _cfg(out, scheduler=scheduler, validation={"metric": "auc", "patience": 50})
        hist = MetricsHistory()
        result = Trainer(model, _train(), cfg, eval_data=_eval(), callbacks=[hist, *extra]).fit()
        return result, hist

    ref = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    ref_result, ref_hist = run(tmp_path / "ref", ref)

    model = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    first, _ = run(tmp_path / "run", model, InterruptAt())  # mid-epoch 2 (8 steps per epoch)
    assert first.reason == "preempted" and first.steps == 13
    saved = st.loads(SafetensorsCheckpointStore(tmp_path / "run/checkpoints").load().metadata["securetrain.train.state"])
    assert saved["extra"]["scheduler"]["last_epoch"] > 0  # the schedule travels in the checkpoint
    fresh = make_mlp(8, 3, hidden=16, dropout=0.3, seed=99)
    torch.manual_seed(12345)
    second, hist = run(tmp_path / "run", fresh)
    assert second.resumed_from == 13 and second.steps == ref_result.steps == 32
    for k, v in ref.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    # Validation history and curves (restored from the checkpoint) match the uninterrupted run.
    assert [v["loss"] for v in second.validation] == [v["loss"] for v in ref_result.validation]
    assert second.best == {**ref_result.best, "checkpoint": None}
    assert [(m.step, m.lr, m.loss) for m in hist.history] == [(m.step, m.lr, m.loss) for m in ref_hist.history]


def test_scheduler_lr_shapes(tmp_path: Path) -> None:
    def lrs(cfg: dict, total: int = 20, per_epoch: int = 5) -> list[float]:
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        s = build_scheduler(SchedulerConfig(**cfg), opt, total_steps=total, steps_per_epoch=per_epoch)
        out = []
        for _ in range(total):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            s.step()
        return out

    cos = lrs({"name": "cosine", "warmup_steps": 4, "warmup_start_factor": 0.25})
    assert cos[0] == pytest.approx(0.25) and cos[4] == pytest.approx(1.0) and cos[-1] < 0.05
    assert all(a < b for a, b in zip(cos[:4], cos[1:5]))  # rises during warm-up
    step = lrs({"name": "step", "step_epochs": 2, "gamma": 0.5}, total=25)
    assert step[9] == 1.0 and step[10] == step[19] == 0.5 and step[20] == 0.25
    one = lrs({"name": "onecycle", "warmup_steps": 5})
    assert max(one) == pytest.approx(1.0, rel=1e-3) and one.index(max(one)) in (4, 5) and one[-1] < 0.01
    assert build_scheduler(SchedulerConfig(), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0),
                           total_steps=10, steps_per_epoch=5) is None
    with pytest.raises(TrainingError, match="step_epochs or step_steps"):
        lrs({"name": "step"})
    with pytest.raises(TrainingError, match="known run length"):
        build_scheduler(SchedulerConfig(name="cosine"), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0),
                        total_steps=None, steps_per_epoch=None)


def test_scheduler_argument_and_mismatch_on_resume(tmp_path: Path) -> None:
    factory = lambda opt, total, per_epoch: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    hist = MetricsHistory()
    Trainer(make_mlp(8, 3, seed=1), _train(), _cfg(tmp_path, epochs=1), scheduler=factory, callbacks=[hist]).fit()
    assert [m.lr for m in hist.history][:4] == [5e-3, 2.5e-3, 2.5e-3, 1.25e-3]
    # The checkpoint has a scheduler; a run without one must not silently resume from it.
    with pytest.raises(ResumeMismatchError, match="scheduler"):
        Trainer(make_mlp(8, 3, seed=1), _train(), _cfg(tmp_path, epochs=2)).fit()


def test_unknown_validation_metric_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, epochs=1, validation={"metric": "f1"})
    with pytest.raises(TrainingError, match=r"validation.metric 'f1' is not one of the validation metrics \(accuracy, auc"):
        Trainer(make_mlp(8, 3, seed=1), _train(), cfg, eval_data=_eval()).fit()


def test_best_tracker_modes_and_state() -> None:
    t = BestTracker("loss", maximize=False, min_delta=0.1)
    assert t.update({"loss": 1.0}, epoch=1, step=1)
    assert not t.update({"loss": 0.95}, epoch=2, step=2)  # within min_delta: not an improvement
    assert t.update({"loss": 0.5}, epoch=3, step=3) and t.bad_validations == 0
    assert not t.update({"loss": float("nan")}, epoch=4, step=4) and t.bad_validations == 1
    u = BestTracker("loss", maximize=False)
    u.load_state_dict(st.loads(st.dumps(t.state_dict())))
    assert (u.best, u.best_epoch, u.bad_validations, len(u.history)) == (0.5, 3, 1, 4)
    assert TrainingConfig(validation={"metric": "auc"}).validation.maximize
    assert not TrainingConfig(validation={"metric": "val_loss"}).validation.maximize


def test_secure_defaults_follow_the_configured_key_source_and_audit_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from securetrain.audit.log import AuditLog
    from securetrain.crypto.checkpoint import EncryptedCheckpointStore

    for name in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_KEK", "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(name, raising=False)
    plain = Trainer(make_mlp(8, 3, seed=1), _train(), _cfg(tmp_path / "plain", max_steps=1))
    assert isinstance(plain.store, SafetensorsCheckpointStore)  # no key source: development default

    monkeypatch.setenv("SECURETRAIN_KEK", os.urandom(32).hex())
    monkeypatch.setenv("SECURETRAIN_KEK_ID", "ops-kek")
    monkeypatch.setenv("SECURETRAIN_AUDIT_URL", str(tmp_path / "audit.db"))
    from securetrain.audit.keys import create_signing_key

    create_signing_key(tmp_path / "audit-signing.pem")  # the operator's `securetrain audit keygen`
    monkeypatch.setenv("SECURETRAIN_AUDIT_KEY", str(tmp_path / "audit-signing.pem"))
    trainer = Trainer(make_mlp(8, 3, seed=1), _train(), _cfg(tmp_path / "secure", max_steps=2))
    assert isinstance(trainer.store, EncryptedCheckpointStore)
    result = trainer.fit()
    assert result.checkpoint.key_id == "ops-kek" and result.checkpoint.path.suffix == ".stenc"
    assert b"model/0.weight" not in result.checkpoint.path.read_bytes()
    with AuditLog(str(tmp_path / "audit.db")) as log:
        actions = [e.action for e in log.entries()]
        assert log.verify().ok
    assert actions[0] == "training.start" and "checkpoint.write" in actions and actions[-1] == "training.stop"


def test_default_loss_and_metrics_refuse_outputs_they_cannot_score(tmp_path: Path) -> None:
    """classification_metrics on outputs it cannot score, or a model returning a tuple with the
    default loss, fails with a TrainingError
    that says what to pass, not torch's IndexError/TypeError from inside the engine."""
    from torch.utils.data import TensorDataset

    with pytest.raises(TrainingError, match=r"\[N, classes\] logits") as info:
        classification_metrics(torch.randn(6), torch.randn(6))
    assert "metrics_fn" in (info.value.hint or "")
    with pytest.raises(TrainingError, match="class ids"):
        classification_metrics(torch.randn(6, 3), torch.rand(6, 3))  # soft targets (probabilities)
    with pytest.raises(TrainingError, match="class ids"):
        classification_metrics(torch.randn(6, 3), torch.rand(6) * 3)  # fractional targets
    assert classification_metrics(torch.randn(4, 2), torch.tensor([0.0, 1.0, 1.0, 0.0]))["samples"] == 4

    x = torch.randn(24, 4)
    data = TensorDataset(x, x.sum(dim=1))

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.linear(inputs).squeeze(-1)

    def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    # The default metrics (default_metrics) score float targets of one output per sample as regression.
    scored = Trainer(Regressor(), data, _cfg(tmp_path / "r", epochs=1), loss_fn=mse, eval_data=data).fit()
    assert {"loss", "mae", "rmse", "r2"} <= set(scored.validation[-1])
    result = Trainer(Regressor(), data, _cfg(tmp_path / "ok", epochs=1), loss_fn=mse, eval_data=data,
                     metrics_fn=lambda out, y: {"loss": float(((out - y) ** 2).mean())}).fit()
    assert result.validation[-1]["loss"] >= 0

    class Pair(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 3)

        def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.linear(inputs)
            return logits, logits.softmax(-1)

    with pytest.raises(TrainingError, match="returned tuple") as info:
        Trainer(Pair(), _train(), _cfg(tmp_path / "t", epochs=1)).fit()
    assert "loss_fn" in (info.value.hint or "")


class _RunningScale(torch.nn.Module):
    """Divides by a moving average of the inputs' largest |value|, updated in every forward, train or
    eval (like a moving-average quantisation observer left enabled): the forward changes a buffer
    the training then depends on."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * x.abs().max())
        return x / self.scale


def test_preflight_look_leaves_buffers_as_they_were_so_resume_is_bit_identical(tmp_path: Path) -> None:
    # The look at the first held-out batch before training ran the model's forward once more after a
    # resume than in an uninterrupted run; a forward that updates a buffer (here in eval mode, as a
    # quantisation observer does) then saw a held-out batch the uninterrupted run never fed it there,
    # and the resumed run's weights differed.
    from securetrain.training import TrainerCallback

    class InterruptAt(TrainerCallback):
        def on_step(self, trainer, metrics):  # noqa: ANN001
            if metrics.step == 5:
                trainer.request_stop()

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(_RunningScale(), make_mlp(8, 3, hidden=8, seed=1))

    evaluation = SyntheticClassification(samples=30, features=8, classes=3, seed=7)
    evaluation.inputs = evaluation.inputs * 50  # held-out values far from the training values
    cfg = {"epochs": 2, "validation": {"metric": "loss"}}
    ref = model()
    Trainer(ref, _train(), _cfg(tmp_path / "ref", **cfg), eval_data=evaluation).fit()
    resumed = model()
    first = Trainer(resumed, _train(), _cfg(tmp_path / "run", **cfg), eval_data=evaluation, callbacks=[InterruptAt()]).fit()
    assert first.reason == "preempted"
    resumed = model()
    second = Trainer(resumed, _train(), _cfg(tmp_path / "run", **cfg), eval_data=evaluation).fit()
    assert second.resumed_from == 5
    for k, v in ref.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k

"""Trainer behaviour in-process: exact mid-epoch resume, precision, accumulation, batches, audit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.config.loader import load_model
from securetrain.errors import ConfigError
from securetrain.training import (
    MetricsHistory,
    ResumeMismatchError,
    SafetensorsCheckpointStore,
    Trainer,
    TrainingConfig,
    TrainingError,
)
from securetrain.training import state as st
from securetrain.training.synthetic import SyntheticClassification, make_mlp

torch.set_num_threads(1)


def _data(n: int = 80) -> SyntheticClassification:
    return SyntheticClassification(samples=n, features=8, classes=3, seed=2)


def _cfg(tmp: Path, **kw) -> TrainingConfig:  # noqa: ANN003
    base = dict(epochs=2, batch_size=8, grad_accumulation=2, lr=5e-3, seed=4, output_dir=tmp, log_every=1)
    return TrainingConfig(**(base | kw))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_mid_epoch_resume_is_bit_identical(tmp_path: Path, precision: str) -> None:
    ref = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    Trainer(ref, _data(), _cfg(tmp_path / "ref", precision=precision)).fit()

    model = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    first = Trainer(model, _data(), _cfg(tmp_path / "run", precision=precision, max_steps=3)).fit()
    assert first.steps == 3 and first.reason == "completed"
    saved = st.loads(SafetensorsCheckpointStore(tmp_path / "run/checkpoints").load().metadata["securetrain.train.state"])
    assert (saved["epoch"], saved["position"]) == (0, 6)  # 10 micro-batches per epoch: mid-epoch
    if precision == "fp16":
        assert saved["scaler"]["scale"] > 0  # GradScaler state travels in the checkpoint

    fresh = make_mlp(8, 3, hidden=16, dropout=0.3, seed=99)  # different init: resume must overwrite it
    torch.manual_seed(12345)  # and scrambled global RNG: resume must restore it
    second = Trainer(fresh, _data(), _cfg(tmp_path / "run", precision=precision)).fit()
    assert second.resumed_from == 3 and second.steps == 10
    for k, v in _weights(ref).items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def test_resume_without_rng_restore_would_differ(tmp_path: Path) -> None:
    """Guards the test above against passing trivially: dropout makes RNG matter."""
    a = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    Trainer(a, _data(), _cfg(tmp_path / "a", seed=4)).fit()
    b = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    Trainer(b, _data(), _cfg(tmp_path / "b", seed=5)).fit()
    assert any(not torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_resume_refuses_changed_settings(tmp_path: Path) -> None:
    Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, max_steps=2)).fit()
    with pytest.raises(ResumeMismatchError, match="batch_size"):
        Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, batch_size=4)).fit()
    # resume=False starts over instead
    r = Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, batch_size=4, resume=False, max_steps=1)).fit()
    assert r.resumed_from is None and r.steps == 1


def test_resume_refuses_a_changed_model_with_a_typed_error(tmp_path: Path) -> None:
    """A user's model whose architecture changed since the checkpoint (wider layer, an added or
    renamed module, a newly frozen parameter) is refused with ResumeMismatchError naming the
    tensors, not torch's multi-line RuntimeError/ValueError."""
    Trainer(make_mlp(8, 3, hidden=16, seed=1), _data(), _cfg(tmp_path, max_steps=2)).fit()
    with pytest.raises(ResumeMismatchError, match=r"model does not match.*shape") as info:
        Trainer(make_mlp(8, 3, hidden=24, seed=1), _data(), _cfg(tmp_path)).fit()
    assert "resume=false" in (info.value.hint or "")

    class Extra(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_mlp(8, 3, hidden=16, seed=1)
            self.extra = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.extra(self.body(x))

    with pytest.raises(ResumeMismatchError, match="model does not match"):
        Trainer(Extra(), _data(), _cfg(tmp_path)).fit()

    frozen = make_mlp(8, 3, hidden=16, seed=1)
    next(frozen.parameters()).requires_grad_(False)  # same tensors, fewer optimised parameters
    with pytest.raises(ResumeMismatchError, match="optimizer"):
        Trainer(frozen, _data(), _cfg(tmp_path)).fit()


def test_resume_refuses_another_optimizer_with_a_typed_error(tmp_path: Path) -> None:
    """Resuming AdamW state into SGD (or back) is refused before training: SGD's step raised a bare
    KeyError('momentum') on the AdamW hyperparameters the checkpoint put in its param groups."""
    Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "adamw", max_steps=2)).fit()
    with pytest.raises(ResumeMismatchError, match=r"optimizer.*momentum"):
        Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "adamw"),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)).fit()
    Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "sgd", max_steps=2),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)).fit()
    with pytest.raises(ResumeMismatchError, match=r"optimizer.*AdamW needs"):
        Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "sgd")).fit()
    resumed = Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "sgd", max_steps=4),
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)).fit()
    assert resumed.resumed_from == 2 and resumed.steps == 4


def test_grad_accumulation_matches_big_batch(tmp_path: Path) -> None:
    kw = dict(epochs=1, shuffle=False, grad_clip=None, lr=0.1)
    a, b = make_mlp(8, 3, seed=1), make_mlp(8, 3, seed=1)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    Trainer(a, _data(64), _cfg(tmp_path / "a", batch_size=16, grad_accumulation=1, **kw), optimizer=sgd).fit()
    Trainer(b, _data(64), _cfg(tmp_path / "b", batch_size=8, grad_accumulation=2, **kw), optimizer=sgd).fit()
    for k in a.state_dict():
        torch.testing.assert_close(a.state_dict()[k], b.state_dict()[k], rtol=1e-5, atol=1e-6)


def test_short_last_window_is_a_true_mean(tmp_path: Path) -> None:
    # 24 samples, batch 8, accum 2: windows of 2 and 1 micro-batches; the lone one must not be halved.
    kw = dict(epochs=1, shuffle=False, grad_clip=None, lr=0.1, grad_accumulation=2, batch_size=8)
    a = make_mlp(8, 3, seed=1)
    r = Trainer(a, _data(24), _cfg(tmp_path / "a", **kw), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).fit()
    assert r.steps == 2
    b = make_mlp(8, 3, seed=1)
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    d = _data(24)
    for sl in (slice(0, 16), slice(16, 24)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(b(d.inputs[sl]), d.targets[sl]).backward()
        opt.step()
    for k in a.state_dict():
        torch.testing.assert_close(a.state_dict()[k], b.state_dict()[k], rtol=1e-5, atol=1e-6)


def test_grad_clip_bounds_update(tmp_path: Path) -> None:
    big = lambda p: torch.optim.SGD(p, lr=1.0)  # noqa: E731
    m0 = make_mlp(8, 3, seed=1)
    before = torch.nn.utils.parameters_to_vector(m0.parameters()).clone()
    Trainer(m0, _data(), _cfg(tmp_path, max_steps=1, grad_clip=1e-3, grad_accumulation=1), optimizer=big).fit()
    delta = torch.nn.utils.parameters_to_vector(m0.parameters()) - before
    assert delta.norm() <= 1e-3 * 1.0001


class DictData(Dataset):
    def __init__(self, key_x: str, key_y: str) -> None:
        self.base, self.kx, self.ky = _data(32), key_x, key_y

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.base[i]
        return {self.kx: x, self.ky: y, "id": torch.tensor(i)}


@pytest.mark.parametrize("kx,ky", [("inputs", "label"), ("pixels", "labels"), ("features", "target")])
def test_dict_batches(tmp_path: Path, kx: str, ky: str) -> None:
    r = Trainer(make_mlp(8, 3, seed=1), DictData(kx, ky), _cfg(tmp_path, max_steps=2)).fit()
    assert r.steps == 2


def test_bad_batch_is_actionable(tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match="cannot find inputs/targets") as exc:
        Trainer(make_mlp(8, 3, seed=1), DictData("x", "y"), _cfg(tmp_path, max_steps=1)).fit()
    assert "loss_fn" in str(exc.value)


def test_user_dataloader_and_custom_loss(tmp_path: Path) -> None:
    calls = []

    def loss_fn(model, batch):  # noqa: ANN001
        calls.append(batch[0].shape[0])
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y) + 0.0 * model[0].weight.sum()

    loader = DataLoader(_data(40), batch_size=5, shuffle=True)
    r = Trainer(make_mlp(8, 3, seed=1), loader, _cfg(tmp_path, epochs=1, grad_accumulation=1), loss_fn=loss_fn).fit()
    assert r.steps == 8 and calls == [5] * 8  # the loader's batch size is kept


class FloatLabels(Dataset):
    """Class ids as floats (1.0), as read from a CSV or numpy; ``fraction`` makes one fractional."""

    def __init__(self, fraction: bool = False) -> None:
        self.base, self.fraction = _data(40), fraction

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):  # noqa: ANN204
        x, y = self.base[i]
        return x, torch.tensor(float(y) + (0.5 if self.fraction and i == 3 else 0.0))


def test_float_class_ids_train_like_integer_ones(tmp_path: Path) -> None:
    # torch's cross_entropy refused them ("expected scalar type Long"): a CSV dataset could not train.
    model = make_mlp(8, 3, seed=1)
    x = torch.randn(4, 8)
    from securetrain.training.losses import cross_entropy_loss

    assert torch.equal(cross_entropy_loss(model, (x, torch.tensor([0.0, 2.0, 1.0, 1.0]))),
                       cross_entropy_loss(model, (x, torch.tensor([0, 2, 1, 1]))))
    soft = torch.softmax(torch.randn(4, 3), dim=1)  # class probabilities, shaped like the logits: unchanged
    assert torch.isfinite(cross_entropy_loss(model, (x, soft)))
    r = Trainer(make_mlp(8, 3, seed=1), FloatLabels(), _cfg(tmp_path / "a", epochs=1)).fit()
    assert r.steps > 0
    with pytest.raises(TrainingError, match="fractional") as exc:
        Trainer(make_mlp(8, 3, seed=1), FloatLabels(fraction=True), _cfg(tmp_path / "b", epochs=1)).fit()
    assert "loss_fn" in str(exc.value)


def test_an_empty_validation_set_is_refused_up_front(tmp_path: Path) -> None:
    # It crashed in argmax at the end of the first epoch, after the epoch's work.
    empty = torch.utils.data.TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    for eval_data in (empty, DataLoader(empty, batch_size=4)):
        with pytest.raises(TrainingError, match="eval_data is empty"):
            Trainer(make_mlp(8, 3, seed=1), _data(16), _cfg(tmp_path, epochs=1), eval_data=eval_data)


def test_nonfinite_loss_fails_closed(tmp_path: Path) -> None:
    def nan_loss(model, batch):  # noqa: ANN001
        return model(batch[0]).sum() * float("nan")

    audit = MemoryAuditRecorder()
    with pytest.raises(TrainingError, match="non-finite"):
        Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path), loss_fn=nan_loss, audit=audit).fit()
    assert audit.events[-1]["action"] == "training.stop" and audit.events[-1]["outcome"] == "failure"


def test_bf16_on_cpu_runs_and_learns(tmp_path: Path) -> None:
    hist = MetricsHistory()
    r = Trainer(make_mlp(8, 3, seed=1), _data(160), _cfg(tmp_path, precision="bf16", epochs=4, lr=1e-2),
                callbacks=[hist]).fit()
    assert r.precision == "bf16"
    assert hist.history[-1].loss < hist.history[0].loss


def test_metrics_audit_and_checkpoints(tmp_path: Path) -> None:
    audit, hist = MemoryAuditRecorder(), MetricsHistory()
    cfg = _cfg(tmp_path, checkpoint_every=3, log_every=2, keep_last=None)
    r = Trainer(make_mlp(8, 3, seed=1), _data(), cfg, audit=audit, callbacks=[hist]).fit()
    assert r.steps == 10 and r.checkpoint is not None and r.checkpoint.step == 10
    assert [m.step for m in hist.history] == [2, 4, 6, 8, 10]
    m = hist.history[-1]
    assert m.samples_per_s > 0 and m.total_steps == 10 and "process_rss" in m.memory and m.loss == r.final_loss
    actions = [e["action"] for e in audit.events]
    assert actions == ["training.start"] + ["checkpoint.write"] * 4 + ["training.stop"]
    assert [e["details"]["step"] for e in audit.events if e["action"] == "checkpoint.write"] == [3, 6, 9, 10]
    stop = audit.events[-1]["details"]
    assert stop["reason"] == "completed" and stop["steps"] == 10 and stop["final_loss"] == r.final_loss
    assert audit.events[-2]["details"]["sha256"] == r.checkpoint.sha256
    assert [c.step for c in hist.checkpoints] == [3, 6, 9, 10]


def test_request_stop_reports_preempted(tmp_path: Path) -> None:
    from securetrain.training import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step(self, trainer, metrics):  # noqa: ANN001
            if metrics.step == 2:
                trainer.request_stop()

    audit = MemoryAuditRecorder()
    r = Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path), callbacks=[StopAt()], audit=audit).fit()
    assert (r.reason, r.steps, r.exit_code) == ("preempted", 2, 75)
    assert audit.events[-1]["details"]["reason"] == "preempted" and r.checkpoint.step == 2


def test_config_validation_and_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="epochs or max_steps"):
        load_model(TrainingConfig, data={"epochs": None})
    with pytest.raises(ConfigError, match="precision"):
        load_model(TrainingConfig, data={"precision": "fp8"})
    with pytest.raises(ConfigError, match="bogus"):
        load_model(TrainingConfig, data={"bogus": 1})
    # A section loaded on its own takes its section's variables (the names used inside a full config).
    env = {"SECURETRAIN_TRAINING__MAX_STEPS": "7", "SECURETRAIN_TRAINING__GRAD_CLIP": "null"}
    cfg = load_model(TrainingConfig, environ=env, env_prefix="SECURETRAIN_TRAINING__")
    assert cfg.max_steps == 7 and cfg.grad_clip is None
    # Top-level SECURETRAIN_* names are other components' secrets, never overrides.
    assert load_model(TrainingConfig, environ={"SECURETRAIN_MAX_STEPS": "7"}).max_steps is None


def test_unknown_device_fails_before_training(tmp_path: Path) -> None:
    from securetrain.errors import DeviceError

    with pytest.raises(DeviceError, match="choose one of"):
        Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, device="tpu")).fit()


def test_dataloader_workers_are_deterministic(tmp_path: Path) -> None:
    a, b = make_mlp(8, 3, seed=1), make_mlp(8, 3, seed=1)
    Trainer(a, _data(48), _cfg(tmp_path / "a", num_workers=1, epochs=1)).fit()
    Trainer(b, _data(48), _cfg(tmp_path / "b", num_workers=1, epochs=1)).fit()
    for k in a.state_dict():
        assert torch.equal(a.state_dict()[k], b.state_dict()[k])


def test_failure_notifies_callbacks(tmp_path: Path) -> None:
    from securetrain.training import TrainerCallback

    seen = []

    class Spy(TrainerCallback):
        def on_error(self, trainer, error):  # noqa: ANN001
            seen.append(type(error).__name__)

    with pytest.raises(TrainingError):
        Trainer(make_mlp(8, 3, seed=1), DictData("x", "y"), _cfg(tmp_path), callbacks=[Spy()]).fit()
    assert seen == ["TrainingError"]


def test_resume_refuses_other_training_data_by_its_digest(tmp_path: Path) -> None:
    # Same length, other content: before, only dataset_len was compared, so a rerun after the data
    # changed resumed the old run's weights on the new data (the record naming only the new data).
    Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, max_steps=2), data_digest="a" * 64).fit()
    with pytest.raises(ResumeMismatchError, match=r"the training data differ from the data its checkpoints were "
                       r"trained on \(digest aaaaaaaaaaaa… vs now bbbbbbbbbbbb…\)") as err:
        Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, max_steps=4), data_digest="b" * 64).fit()
    assert "new run" in str(err.value.hint)
    r = Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path, max_steps=4), data_digest="a" * 64).fit()
    assert r.resumed_from == 2 and r.steps == 4
    # A checkpoint written without a digest (library use, or before digests) resumes as before.
    Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "old", max_steps=2)).fit()
    r = Trainer(make_mlp(8, 3, seed=1), _data(), _cfg(tmp_path / "old", max_steps=4), data_digest="b" * 64).fit()
    assert r.resumed_from == 2

"""DP-SGD through Opacus: ε against Opacus' own accountant, the budget stop, resume from an encrypted
checkpoint, reproducibility, model fixing and the refusals."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

pytest.importorskip("opacus", reason="DP-SGD needs the [privacy] extra (opacus)")

from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402

from securetrain.audit.recorder import MemoryAuditRecorder  # noqa: E402
from securetrain.crypto.checkpoint import EncryptedCheckpointStore  # noqa: E402
from securetrain.crypto.keys import LocalKeyring, SecretKey  # noqa: E402
from securetrain.release.errors import PrivacyError, PrivacyModelError  # noqa: E402
from securetrain.release.privacy import BUDGET_REASON, DPTrainer, trainer_class  # noqa: E402
from securetrain.training.batches import compiled_inner  # noqa: E402
from securetrain.training.callbacks import TrainerCallback  # noqa: E402
from securetrain.training.config import TrainingConfig  # noqa: E402
from securetrain.training.errors import ConstantNormError, ResumeMismatchError, TrainingError  # noqa: E402
from securetrain.training.safetensors_store import SafetensorsCheckpointStore  # noqa: E402
from securetrain.training.trainer import Trainer  # noqa: E402

N = 200


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def _model(norm: bool = False) -> nn.Module:
    torch.manual_seed(1)
    if norm:  # BatchNorm over (N, 2, 2, 2) feature maps: Opacus' fix makes it GroupNorm(2, 2)
        return nn.Sequential(nn.Linear(6, 8), nn.Unflatten(1, (2, 2, 2)), nn.BatchNorm2d(2), nn.Flatten(),
                             nn.ReLU(), nn.Linear(8, 2))
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)


def _config(tmp: Path, **kw: Any) -> TrainingConfig:
    privacy = {"target_epsilon": 3.0, "delta": 1e-3, "max_grad_norm": 1.0, **kw.pop("privacy", {})}
    base = {"epochs": 2, "batch_size": 10, "grad_accumulation": 2, "output_dir": tmp, "device": "cpu",
            "log_every": 1, "precision": "fp32", "privacy": privacy}
    return TrainingConfig(**{**base, **kw})


def _fit(tmp: Path, cfg: TrainingConfig, *, audit: Any = None, callbacks: Any = (), store: Any = None,
         model: nn.Module | None = None, eval_data: Any = None) -> tuple[DPTrainer, Any]:
    trainer = DPTrainer(model or _model(), _data(), cfg, optimizer=_sgd, audit=audit or MemoryAuditRecorder(),
                        store=store or SafetensorsCheckpointStore(tmp / "ckpt"), callbacks=callbacks,
                        eval_data=eval_data)
    return trainer, trainer.fit()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_epsilon_matches_opacus_accountant(tmp_path: Path) -> None:
    audit = MemoryAuditRecorder()
    cfg = _config(tmp_path)
    trainer, result = _fit(tmp_path, cfg, audit=audit)
    p = result.privacy
    steps_per_epoch = -(-N // 20)  # Poisson batches of expected size batch_size x grad_accumulation
    assert result.reason == "completed" and result.steps == 2 * steps_per_epoch
    assert p["sample_rate"] == pytest.approx(1 / steps_per_epoch) and p["expected_batch_size"] == 20
    # The noise is what Opacus plans for (target ε, δ, q, epochs) ...
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-3, sample_rate=1 / steps_per_epoch,
                                 epochs=2, accountant="rdp")
    assert p["noise_multiplier"] == pytest.approx(sigma)
    # ... and ε is what a fresh Opacus accountant computes for exactly the steps taken.
    acc = RDPAccountant()
    acc.history = [(sigma, 1 / steps_per_epoch, result.steps)]
    expected = acc.get_epsilon(delta=1e-3)
    assert p["epsilon"] == pytest.approx(expected, rel=1e-9) and 0 < p["epsilon"] <= 3.0
    assert p["delta"] == 1e-3 and p["target_epsilon"] == 3.0
    # Audit: ε after every epoch, increasing, and once more at the end.
    per_epoch = [e["details"] for e in audit.events if e["action"] == "privacy.epsilon"]
    assert [d["epoch"] for d in per_epoch] == [1, 2]
    assert per_epoch[0]["epsilon"] < per_epoch[1]["epsilon"] == pytest.approx(expected)
    final = [e["details"] for e in audit.events if e["action"] == "privacy.final"]
    assert len(final) == 1 and final[0]["epsilon"] == pytest.approx(expected)
    # DP clipping replaced global clipping; the user's model (not Opacus' wrapper) is returned.
    assert trainer.config.grad_clip is None and isinstance(trainer.model, nn.Sequential)


def test_training_stops_before_exceeding_the_budget(tmp_path: Path) -> None:
    """Noise planned for 1 epoch, 4 epochs asked: the run ends when the next step would overspend."""
    audit = MemoryAuditRecorder()
    cfg = _config(tmp_path, epochs=4, privacy={"plan_epochs": 1, "target_epsilon": 1.0})
    trainer, result = _fit(tmp_path, cfg, audit=audit, eval_data=_data(5))
    p = result.privacy
    assert result.reason == BUDGET_REASON
    assert p["epsilon"] <= 1.0
    # One more step would have exceeded the target: the stop was not premature.
    assert trainer._epsilon_after_next_step() > 1.0
    assert result.steps < 4 * 10
    stop = [e for e in audit.events if e["action"] == "training.stop"][-1]
    assert stop["details"]["reason"] == BUDGET_REASON
    assert result.validation and result.validation[-1]["step"] == result.steps  # metrics of the released weights
    # A resumed run with the budget spent takes no further step.
    _, again = _fit(tmp_path, cfg, audit=audit)
    assert again.reason == BUDGET_REASON and again.steps == result.steps
    assert again.privacy["epsilon"] == pytest.approx(p["epsilon"])


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, trainer: Any, metrics: Any) -> None:
        if metrics.step == self.step:
            trainer.request_stop()


def test_resume_from_encrypted_checkpoint_continues_accountant_and_noise(tmp_path: Path) -> None:
    ring = LocalKeyring([SecretKey("kek", os.urandom(32))], "kek")
    full_cfg = _config(tmp_path / "a")
    _, full = _fit(tmp_path / "a", full_cfg, store=EncryptedCheckpointStore(tmp_path / "a" / "ck", ring))
    cfg = _config(tmp_path / "b")
    _, first = _fit(tmp_path / "b", cfg, store=EncryptedCheckpointStore(tmp_path / "b" / "ck", ring),
                     callbacks=[_StopAt(7)])
    assert first.reason == "preempted" and first.steps == 7
    _, second = _fit(tmp_path / "b", cfg, store=EncryptedCheckpointStore(tmp_path / "b" / "ck", ring))
    assert second.resumed_from == 7 and second.steps == full.steps
    assert second.privacy["epsilon"] == pytest.approx(full.privacy["epsilon"], rel=1e-12)
    # Same Poisson batches and the same noise after resume: bit-identical weights.
    a_store = EncryptedCheckpointStore(tmp_path / "a" / "ck", ring)
    b_store = EncryptedCheckpointStore(tmp_path / "b" / "ck", ring)
    a = a_store.load(a_store.latest()).tensors
    b = b_store.load(b_store.latest()).tensors
    model_keys = [k for k in a if k.startswith("model/")]
    assert model_keys and all(torch.equal(a[k], b[k]) for k in model_keys)


def test_resume_with_changed_budget_is_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _fit(tmp_path, cfg, callbacks=[_StopAt(3)])
    with pytest.raises(ResumeMismatchError, match="privacy"):
        _fit(tmp_path, _config(tmp_path, privacy={"target_epsilon": 8.0}))


def test_resume_of_a_dp_checkpoint_without_dp_is_refused(tmp_path: Path) -> None:
    """Continuing a DP run with the plain trainer would release a model without the privacy its run
    records (it resumed silently); with a fixed BatchNorm the message names the replaced layer."""
    for norm in (False, True):
        folder = tmp_path / str(norm)
        cfg = _config(folder, grad_accumulation=1)  # what the DP trainer records: nothing else differs
        _fit(folder, cfg, callbacks=[_StopAt(3)], model=_model(norm=norm))
        plain = Trainer(_model(norm=norm), _data(), cfg.model_copy(update={"privacy": None}),
                        optimizer=_sgd, store=SafetensorsCheckpointStore(folder / "ckpt"))
        with pytest.raises(ResumeMismatchError, match="written by a DP-SGD run.*this run trains without DP-SGD") as info:
            plain.fit()
        assert ("2 (BatchNorm2d -> GroupNorm)" in str(info.value)) is norm


def test_reproducible_per_seed(tmp_path: Path) -> None:
    t1, _ = _fit(tmp_path / "1", _config(tmp_path / "1", seed=3))
    t2, _ = _fit(tmp_path / "2", _config(tmp_path / "2", seed=3))
    t3, _ = _fit(tmp_path / "3", _config(tmp_path / "3", seed=4))
    w1, w2, w3 = _weights(t1.model), _weights(t2.model), _weights(t3.model)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not all(torch.equal(w1[k], w3[k]) for k in w1)


def test_poisson_batches_vary_in_size_and_are_split_physically(tmp_path: Path) -> None:
    cfg = _config(tmp_path, epochs=1)
    trainer = DPTrainer(_model(), _data(), cfg, optimizer=_sgd, store=SafetensorsCheckpointStore(tmp_path / "c"))
    seen: list[int] = []
    original = trainer.loss_fn

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        seen.append(int(batch[0].shape[0]))
        return original(model, batch)

    trainer.loss_fn = loss
    trainer.fit()
    assert max(seen) <= 10  # physical micro-batches never exceed batch_size
    assert len(set(seen)) > 1  # Poisson: sizes vary


def test_batchnorm_is_fixed_or_refused_naming_the_layer(tmp_path: Path) -> None:
    trainer, result = _fit(tmp_path / "fix", _config(tmp_path / "fix", epochs=1), model=_model(norm=True))
    assert result.reason == "completed"
    assert not any(isinstance(m, nn.BatchNorm2d) for m in trainer.model.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in trainer.model.modules())
    with pytest.raises(PrivacyModelError, match="BatchNorm"):
        _fit(tmp_path / "nofix", _config(tmp_path / "nofix", privacy={"fix_model": False}), model=_model(norm=True))


def _flat_bn_model(channels: int) -> nn.Module:
    """BatchNorm1d over flat [N, C] features (a tabular MLP), at path "1.0": Opacus' fix makes it
    GroupNorm(gcd(32, C), C), one (C <= 32) or two (C = 64) values per sample and group."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, channels), nn.Sequential(nn.BatchNorm1d(channels), nn.ReLU()),
                         nn.Linear(channels, 2))


@pytest.mark.parametrize(("channels", "groups", "erased"), [(8, 8, "1 value per group, normalised to a constant"),
                                                            (64, 32, "2 values per group, normalised to a sign")])
def test_batchnorm_over_flat_features_is_refused_before_training(tmp_path: Path, channels: int, groups: int,
                                                                 erased: str) -> None:
    """The GroupNorm the fix puts there erases its input (the model trained to a constant): refused
    before the first step, naming the layer, what it does and what to do instead."""
    audit = MemoryAuditRecorder()
    with pytest.raises(PrivacyModelError) as info:
        _fit(tmp_path, _config(tmp_path), audit=audit, model=_flat_bn_model(channels))
    message = str(info.value)
    assert f"1.0 (BatchNorm1d -> GroupNorm({groups}, {channels}) over inputs of per-sample shape [{channels}]" in message
    assert erased in message and "nn.LayerNorm" in message and "fix_model: false" in message
    assert not any(e["action"] in ("training.start", "training.step") for e in audit.events)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())  # nothing trained or saved


@pytest.mark.parametrize("own", ["groupnorm", "pooled", "layernorm"])
def test_own_norm_of_one_value_per_group_is_refused_before_training(tmp_path: Path, own: str) -> None:
    """The user's own GroupNorm(C, C) over flat features (or over [N, C, 1, 1] after global pooling),
    LayerNorm(1): Opacus keeps them (they are DP-trainable) and they output their bias whatever
    their input. Refused before the first step like the fix's erasing GroupNorm, naming the layer."""
    torch.manual_seed(1)
    middle = {"groupnorm": [nn.GroupNorm(8, 8)],
              "pooled": [nn.Unflatten(1, (8, 1, 1)), nn.GroupNorm(8, 8), nn.Flatten()],
              "layernorm": [nn.Unflatten(1, (8, 1)), nn.LayerNorm(1), nn.Flatten()]}[own]
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(*middle, nn.ReLU()), nn.Linear(8, 2))
    audit = MemoryAuditRecorder()
    with pytest.raises(ConstantNormError) as info:
        _fit(tmp_path, _config(tmp_path), audit=audit, model=model)
    layer = {"groupnorm": "1.0 (GroupNorm(8, 8) over inputs of per-sample shape [8]",
             "pooled": "1.1 (GroupNorm(8, 8) over inputs of per-sample shape [8, 1, 1]",
             "layernorm": "1.1 (LayerNorm((1,)) over inputs of per-sample shape [8, 1]"}[own]
    assert layer in str(info.value) and "outputs its bias whatever its input" in str(info.value)
    assert not any(e["action"] in ("training.start", "training.step") for e in audit.events)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_own_norms_over_two_values_or_more_train(tmp_path: Path) -> None:
    """No false positives: GroupNorm with two channels per group and LayerNorm over the features."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.GroupNorm(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))
    trainer, result = _fit(tmp_path, _config(tmp_path, epochs=1), model=model)
    assert result.reason == "completed" and result.privacy["replaced_layers"] == []


def test_batchnorm_over_feature_maps_and_sequences_is_still_fixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GroupNorm with one channel per group over [N, C, H, W] or [N, C, L] normalises each channel over
    its positions (InstanceNorm-like): trained as before, and the check's forward leaves no trace (a
    dataset that draws random noise per sample trains to the same weights without the check)."""
    class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
        base = _data()

        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = self.base[i]
            return x + 0.01 * torch.randn(6), y

    seq = nn.Sequential(nn.Linear(6, 8), nn.Unflatten(1, (2, 4)), nn.BatchNorm1d(2), nn.Flatten(), nn.ReLU(),
                        nn.Linear(8, 2))
    for name, model in (("maps", _model(norm=True)), ("seq", seq)):
        def fit(where: str, model: nn.Module = model) -> DPTrainer:
            trainer = DPTrainer(copy.deepcopy(model), Noisy(), _config(tmp_path / where, epochs=1), optimizer=_sgd,
                                audit=MemoryAuditRecorder(), store=SafetensorsCheckpointStore(tmp_path / where / "c"))
            assert trainer.fit().reason == "completed"
            assert isinstance(trainer.model[2], nn.GroupNorm) and trainer.model[2].num_groups == 2
            return trainer

        checked = fit(f"{name}-checked")
        with monkeypatch.context() as m:
            m.setattr(DPTrainer, "_refuse_erasing_norms", lambda self, data, collate: None)
            unchecked = fit(f"{name}-unchecked")
        assert _weights(checked.model).keys() == _weights(unchecked.model).keys()
        assert all(torch.equal(a, b) for a, b in zip(_weights(checked.model).values(),
                                                     _weights(unchecked.model).values(), strict=True))


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(PrivacyError, match="fp32"):
        _fit(tmp_path / "p", _config(tmp_path / "p", precision="bf16"))
    model = _model()
    with pytest.raises(PrivacyError, match="factory"):
        DPTrainer(model, _data(), _config(tmp_path / "o"), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  store=SafetensorsCheckpointStore(tmp_path / "o")).fit()

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[override]
            yield from _data()

    with pytest.raises(PrivacyError, match="map-style"):
        DPTrainer(_model(), Stream(), _config(tmp_path / "i"), optimizer=_sgd,
                  store=SafetensorsCheckpointStore(tmp_path / "i")).fit()
    with pytest.raises(PrivacyError, match="training.privacy"):
        DPTrainer(_model(), _data(), TrainingConfig(output_dir=tmp_path / "n"))
    assert trainer_class(TrainingConfig(output_dir=tmp_path)) is Trainer
    assert trainer_class(_config(tmp_path)) is DPTrainer


def test_closure_optimizers_are_refused(tmp_path: Path) -> None:
    """DP-SGD's optimizer steps once per clipped, noised batch: an optimizer that re-evaluates a
    closure (LBFGS) would look at the data again without noise."""
    with pytest.raises(PrivacyError, match="closure"):
        DPTrainer(_model(), _data(), _config(tmp_path / "l"), optimizer=lambda p: torch.optim.LBFGS(p),
                  store=SafetensorsCheckpointStore(tmp_path / "l")).fit()
    with pytest.raises(PrivacyError, match="closure"):
        DPTrainer(_model(), _data(), _config(tmp_path / "c", closure=True), optimizer=_sgd,
                  store=SafetensorsCheckpointStore(tmp_path / "c")).fit()


@pytest.mark.slow
def test_pipeline_reports_epsilon_in_result_json_and_report(tmp_path: Path) -> None:
    import json

    import yaml
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "examples" / "finance.yaml").read_text())
    data.update(name="fin", output_dir=str(tmp_path / "runs"), he={"enabled": False})
    data["data"].update(policy=str(root / "policies" / "finance-pii.yaml"),
                        synthetic_table={"rows": 600, "customers": 120, "seed": 1})
    data["training"].update(epochs=3, batch_size=64, checkpoint_every=4, log_every=2, precision="fp32",
                            privacy={"target_epsilon": 4.0, "delta": 1e-4})
    config_file = tmp_path / "fin.yaml"
    config_file.write_text(yaml.safe_dump(data))
    out = CliRunner().invoke(app, ["run", str(config_file), "--no-prefect"])
    assert out.exit_code == 0, out.output + repr(out.exception)
    run_dir = tmp_path / "runs" / "fin"
    result = json.loads((run_dir / "result.json").read_text())
    p = result["training"]["privacy"]
    assert 0 < p["epsilon"] <= 4.0 and p["delta"] == 1e-4 and p["target_epsilon"] == 4.0
    report = next(run_dir.glob("*.html")).read_text()
    assert "differential privacy" in report and f"{p['epsilon']:.4f}" in report


@pytest.mark.slow
def test_ddp_two_ranks_stay_identical_and_resume_exactly(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    worker = Path(__file__).with_name("dp_ddp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(worker), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    full = [json.loads((tmp_path / "full" / f"rank{r}.json").read_text()) for r in (0, 1)]
    # 120 samples, logical batch 6 x 2 accumulation x 2 ranks = 24 -> q = 1/5, 5 steps per epoch.
    assert full[0] == full[1] and full[0]["steps"] == 10 and full[0]["reason"] == "completed"
    assert full[0]["sample_rate"] == pytest.approx(1 / 5) and 0 < full[0]["epsilon"] <= 3.0
    resumed = [json.loads((tmp_path / "resumed" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert resumed[0] == resumed[1] == full[0]  # stopped at step 3, resumed: same weights and ε


# --- the plain trainer's checks under DP-SGD ------------------------------------------------

@pytest.mark.parametrize("target", ["float_1d", "multi_hot"])
def test_default_loss_refuses_regression_and_multilabel_targets(tmp_path: Path, target: str) -> None:
    """The default cross-entropy's refusals (one value per sample, multi-hot rows) hold under DP-SGD
    as in the plain trainer, naming the loss to pass, before any step."""
    x = _data().tensors[0]
    if target == "float_1d":
        model: nn.Module = nn.Sequential(nn.Linear(6, 1), nn.Flatten(0))
        data, match = TensorDataset(x, x[:, 0]), r"outputs of shape \[\d+\].*MSELoss"
    else:
        model, data, match = nn.Linear(6, 4), TensorDataset(x, (x[:, :4] > 0).float()), "BCEWithLogitsLoss"
    trainer = DPTrainer(model, data, _config(tmp_path), optimizer=_sgd, store=SafetensorsCheckpointStore(tmp_path / "c"))
    with pytest.raises(TrainingError, match=match):
        trainer.fit()
    assert trainer.progress.step == 0


@pytest.mark.parametrize(("loss_fn", "match"), [
    (lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none"),
     r"per-sample losses of shape \[\d+\]"),
    (lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]).item(), "float"),
], ids=["per_sample", "python_float"])
def test_a_loss_that_is_not_a_scalar_tensor_is_refused_with_a_hint(tmp_path: Path, loss_fn: Any, match: str) -> None:
    """Was torch's 'grad can be implicitly created only for scalar outputs' (or an AttributeError):
    DP-SGD's step skipped the plain trainer's check of what loss_fn returns."""
    trainer = DPTrainer(_model(), _data(), _config(tmp_path), optimizer=_sgd, loss_fn=loss_fn,
                        store=SafetensorsCheckpointStore(tmp_path / "c"))
    with pytest.raises(TrainingError, match=match) as info:
        trainer.fit()
    assert "mean" in str(info.value)


def test_batchnorm_refusal_and_fix_name_the_layer_and_groupnorm(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Per-sample gradients through BatchNorm are wrong (it mixes the samples of a batch). Refused
    (fix_model: false) as a PrivacyModelError that names the layer by its path and GroupNorm as the
    fix; replaced (fix_model: true) with a warning that names the layer, the replacement and that the
    model passed in is not the one trained."""
    def model() -> nn.Module:
        base = _model(norm=True)
        return nn.Sequential(base[0], nn.Sequential(base[1], base[2]), *base[3:])  # the BatchNorm at "1.1"

    with pytest.raises(PrivacyModelError, match=r"1\.1 \(BatchNorm2d\)") as info:
        _fit(tmp_path / "nofix", _config(tmp_path / "nofix", privacy={"fix_model": False}), model=model())
    assert "GroupNorm" in str(info.value) and "fix_model" in str(info.value)
    passed = model()
    with caplog.at_level("WARNING", logger="securetrain"):
        trainer, result = _fit(tmp_path / "fix", _config(tmp_path / "fix", epochs=1), model=passed)
    assert result.reason == "completed" and trainer.model is not passed
    warned = [r.getMessage() for r in caplog.records if "GroupNorm" in r.getMessage()]
    assert warned and "1.1 (BatchNorm2d -> GroupNorm)" in warned[0] and "trainer.model" in warned[0]


def test_a_compiled_model_trains_under_dp_with_plain_checkpoint_names(tmp_path: Path) -> None:
    """Opacus' per-sample hooks go on the user's module, not on torch.compile's wrapper; the
    checkpoint holds the plain names (no _orig_mod.)."""
    try:
        compiled = torch.compile(_model(), backend="eager")
        compiled(torch.zeros(2, 6))
    except Exception as exc:  # noqa: BLE001 - this torch build cannot compile here
        pytest.skip(f"torch.compile(backend='eager') does not work here: {exc}")
    trainer, result = _fit(tmp_path, _config(tmp_path, epochs=1), model=compiled)
    assert result.reason == "completed" and result.steps > 0
    assert compiled_inner(trainer.model) is None and trainer.model is compiled._orig_mod  # trained uncompiled
    names = {k for k in SafetensorsCheckpointStore(tmp_path / "ckpt").load().tensors if k.startswith("model/")}
    assert names == {f"model/{k}" for k in _model().state_dict()}

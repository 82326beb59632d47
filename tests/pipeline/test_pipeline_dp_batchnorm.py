"""DP-SGD on a model with BatchNorm through the pipeline: Opacus' fix trains GroupNorm, and every
consumer of the trained weights (HE stage, load_trained_model, provenance/release, resume) rebuilds
that architecture, or refuses a mismatch with a typed error; never the BatchNorm model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline

from .pipeline_fixtures import finance_config

pytest.importorskip("opacus", reason="DP-SGD needs the [privacy] extra (opacus)")
pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")

BN_MODELS = '''
from torch import nn


def bn_net(in_features, num_classes):
    # BatchNorm over (N, 2, 2, 2) maps: Opacus' fix makes it GroupNorm(2, 2) (over [N, C] features
    # it would be GroupNorm(C, C): one value per group, normalised to a constant)
    return nn.Sequential(nn.Linear(in_features, 8), nn.Unflatten(1, (2, 2, 2)), nn.BatchNorm2d(2), nn.Flatten(),
                         nn.ReLU(), nn.Linear(8, num_classes))


def flat_bn_net(in_features, num_classes):
    # a tabular MLP's BatchNorm1d over [N, C] features: refused under DP-SGD (GroupNorm(8, 8) erases it)
    return nn.Sequential(nn.Linear(in_features, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, num_classes))


def plain_net(in_features, num_classes):
    return nn.Sequential(nn.Linear(in_features, 8), nn.Unflatten(1, (2, 2, 2)), nn.Identity(), nn.Flatten(),
                         nn.ReLU(), nn.Linear(8, num_classes))
'''
REPLACED = [{"layer": "2", "from": "BatchNorm2d", "to": "GroupNorm"}]


def _config(tmp: Path, **sections):  # noqa: ANN202
    data = finance_config(tmp, name="dpbn", model={"target": "bnmodels:bn_net", "kwargs": {}},
                          he={"enabled": True, "scope": "auto"}, **sections)
    data["data"]["synthetic_table"] = {"rows": 240, "customers": 60, "seed": 1}
    data["training"].update(epochs=2, precision="fp32", privacy={"target_epsilon": 4.0, "delta": 1e-4, "accountant": "gdp"},
                            scheduler={"name": "constant"})  # a run may go on for another epoch (resume test)
    config = load_pipeline_config(data=data)
    config.base_dir = tmp  # the user's model module lives next to the (virtual) config file
    return config


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("dpbn")
    (tmp / "bnmodels.py").write_text(BN_MODELS)
    config = _config(tmp)
    return config, run_pipeline(config)


def _secrets(config):  # noqa: ANN001, ANN202
    from securetrain.pipeline.secrets import load_run_secrets

    return load_run_secrets(config)


def test_the_run_scores_the_groupnorm_model_it_trained(dp_run) -> None:
    config, result = dp_run
    assert result.he is not None and result.he.samples > 0  # the HE stage rebuilt the trained model
    assert result.training.privacy["replaced_layers"] == REPLACED
    saved = json.loads(result.result_json.read_text())
    assert saved["training"]["privacy"]["replaced_layers"] == REPLACED
    assert "layers replaced for DP-SGD (trained and saved so): 2 (BatchNorm2d -&gt; GroupNorm)" in \
        result.report_html.read_text()


@pytest.mark.parametrize("which", ["last", "best"])
def test_load_trained_model_rebuilds_the_trained_architecture(dp_run, which: str) -> None:
    from securetrain.pipeline.stages import load_trained_model, run_checkpoint_store

    config, _ = dp_run
    model = load_trained_model(config, _secrets(config), which=which)
    assert isinstance(model[2], nn.GroupNorm) and not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    store = run_checkpoint_store(config, _secrets(config), None, best=which == "best")
    tensors = store.load().tensors
    state = model.state_dict()
    assert set(state) == {k.removeprefix("model/") for k in tensors if k.startswith("model/")}
    assert all(torch.equal(v, tensors[f"model/{k}"]) for k, v in state.items())


def test_checkpoints_and_provenance_record_the_fix(dp_run) -> None:
    from securetrain.pipeline.stages import run_checkpoint_store
    from securetrain.training.architecture import read_model_fix

    config, result = dp_run
    for best in (False, True):
        loaded = run_checkpoint_store(config, _secrets(config), None, best=best).load()
        assert read_model_fix(loaded.metadata) == REPLACED
    statement = json.loads(__import__("base64").b64decode(
        json.loads((config.run_dir / "release" / "provenance.dsse.json").read_text())["payload"]))
    assert statement["predicate"]["privacy"]["replaced_layers"] == REPLACED


def test_a_model_that_no_longer_matches_the_recorded_fix_is_refused(dp_run, tmp_path: Path) -> None:
    from securetrain.pipeline.stages import load_trained_model
    from securetrain.training.errors import ModelArchitectureError

    config, _ = dp_run
    other = config.model_copy(deep=True)
    other.model.target = "bnmodels:plain_net"  # the same net without BatchNorm: nothing to fix
    with pytest.raises(ModelArchitectureError, match=r"2 \(BatchNorm2d -> GroupNorm\)"):
        load_trained_model(other, _secrets(other))


def test_the_fixed_model_loads_whatever_the_config_now_says_about_privacy(dp_run) -> None:
    from securetrain.pipeline.stages import load_trained_model

    config, _ = dp_run
    plain = config.model_copy(deep=True)
    plain.training.privacy = None  # the checkpoint, not today's config, says what was trained
    assert isinstance(load_trained_model(plain, _secrets(plain))[2], nn.GroupNorm)


def test_a_checkpoint_from_before_the_record_loads_by_the_config_or_is_refused(dp_run, tmp_path: Path) -> None:
    """A DP checkpoint without the record (written before it existed) holds GroupNorm weights: a DP
    config that fixes models rebuilds them; one without DP gets a typed error, not torch's RuntimeError."""
    import shutil

    from securetrain.pipeline.stages import load_trained_model, run_checkpoint_store
    from securetrain.training.architecture import MODEL_FIX_KEY
    from securetrain.training.errors import ModelArchitectureError

    config, _ = dp_run
    old = config.model_copy(deep=True)
    old.output_dir = tmp_path
    shutil.copytree(config.run_dir, old.run_dir)
    store = run_checkpoint_store(old, _secrets(old), None)
    loaded = store.load()
    metadata = {k: v for k, v in loaded.metadata.items() if k != MODEL_FIX_KEY}
    store.save(loaded.info.step + 1, loaded.tensors, metadata)  # now the latest
    assert isinstance(load_trained_model(old, _secrets(old))[2], nn.GroupNorm)
    old.training.privacy = None
    with pytest.raises(ModelArchitectureError, match=r"not in the checkpoint: 2\.running_mean"):
        load_trained_model(old, _secrets(old))


def test_resume_without_dp_is_refused_naming_the_fix(dp_run) -> None:
    from securetrain.pipeline import stages
    from securetrain.training.errors import ResumeMismatchError

    config, _ = dp_run
    plain = config.model_copy(deep=True)
    plain.training.privacy = None
    plain.training.epochs = 3
    with pytest.raises(ResumeMismatchError, match="GroupNorm"):
        stages.train(plain, None, _secrets(plain))


def test_a_dp_run_resumes_from_its_checkpoint(dp_run) -> None:
    from securetrain.pipeline import stages

    config, result = dp_run
    more = config.model_copy(deep=True)
    more.training.epochs = 3
    more.training.privacy = more.training.privacy.model_copy(update={"plan_epochs": 2})  # same noise as trained
    summary = stages.train(more, None, _secrets(more))
    # the GroupNorm weights went back into the fixed model; the budget planned for 2 epochs is spent
    assert summary.resumed_from == result.training.steps and summary.reason == "privacy_budget"
    assert summary.privacy["replaced_layers"] == REPLACED


def test_a_tabular_batchnorm_model_is_refused_before_training(tmp_path: Path) -> None:
    """The finance MLP's BatchNorm1d over [N, C] features would become a GroupNorm that outputs a
    constant: the run stops before training with a PrivacyModelError naming the layer."""
    from securetrain.release.errors import PrivacyModelError

    (tmp_path / "bnmodels.py").write_text(BN_MODELS)
    config = _config(tmp_path)
    config.model.target = "bnmodels:flat_bn_net"
    with pytest.raises(PrivacyModelError, match=r"1 \(BatchNorm1d -> GroupNorm\(8, 8\).*constant") as info:
        run_pipeline(config)
    assert "nn.LayerNorm" in str(info.value)
    assert not list((tmp_path / "runs").rglob("step-*"))  # no checkpoint: nothing trained

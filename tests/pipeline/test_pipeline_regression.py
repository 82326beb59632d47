"""Regression in the pipeline: the built-in ``tabular-regression`` task (a finance table with a
decimal ``loss_amount`` target) end to end through ``securetrain run --no-prefect``, its refusals
(non-numeric or non-finite targets, HE scoring, class settings), and custom tasks returning
``TaskData(kind="regression")``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from securetrain.cli.main import app
from securetrain.errors import ConfigError
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.errors import ModelOutputError, TaskError
from securetrain.pipeline.runner import run_pipeline

POLICY = """\
policy_version: "1"
name: claims
description: Insurance claims with a loss amount to predict.
columns:
  - name: customer_id
    action: tokenize
    domain: customer
  - name: customer_name
    action: tokenize
    domain: person
  - name: region
    action: keep
  - name: tenure_years
    action: keep
  - name: premium
    action: keep
  - name: loss_amount
    action: keep
"""


def _claims_csv(path: Path, rows: int = 240, *, target: list[str] | None = None,
                scale: float | None = None, offset: float = 0.0) -> Path:
    """A synthetic claims table: ~60 customers, loss_amount = linear in premium and tenure + noise
    (``scale``/``offset``: the amount in other units, e.g. a price in the hundred-thousands)."""
    rng = np.random.default_rng(0)
    customers = rng.integers(0, 60, rows)
    regions = ["north", "south", "east", "west"]
    lines = ["customer_id,customer_name,region,tenure_years,premium,loss_amount"]
    for i in range(rows):
        c = int(customers[i])
        premium = round(float(rng.uniform(100, 900)), 2)
        tenure = int(rng.integers(0, 20))
        loss = 0.5 * premium - 4.0 * tenure + rng.normal(0, 5)
        amount = loss / 100 if scale is None else loss * scale + offset
        value = target[i] if target is not None else f"{amount:.2f}"
        lines.append(f"C{c:04d},Person Number{c},{regions[c % 4]},{tenure},{premium:.2f},{value}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(tmp: Path, **sections: Any) -> dict[str, Any]:
    (tmp / "claims-policy.yaml").write_text(POLICY)
    data: dict[str, Any] = {
        "name": "claims",
        "output_dir": str(tmp / "runs"),
        "task": "tabular-regression",
        "data": {"source": str(_claims_csv(tmp / "claims.csv")), "policy": str(tmp / "claims-policy.yaml"),
                 "label_column": "loss_amount", "split_by": "customer_id", "eval_fraction": 0.25},
        "model": {"target": "mlp", "kwargs": {"hidden": [8]}},
        "training": {"epochs": 1, "batch_size": 32, "lr": 0.01, "log_every": 2, "checkpoint_every": 100, "seed": 0},
        "secrets": {"create_demo_secrets": True},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def test_tabular_regression_runs_end_to_end_from_the_cli(tmp_path: Path) -> None:
    config_file = tmp_path / "claims.yaml"
    config_file.write_text(yaml.safe_dump(_config(tmp_path)))
    result = CliRunner().invoke(app, ["run", str(config_file), "--no-prefect"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    run_dir = tmp_path / "runs" / "claims"
    out = json.loads((run_dir / "result.json").read_text())
    assert out["task"] == "tabular-regression"
    t = out["training"]
    assert t["task_kind"] == "regression" and t["class_names"] == [] and t["label_map"] == {}
    assert t["validation_metric"] == "rmse"  # the regression default, minimised
    assert t["best"]["metric"] == "rmse" and t["best_checkpoint"] is not None
    last = t["validation"][-1]
    assert {"rmse", "mae", "r2", "loss"} <= set(last) and "accuracy" not in last and "confusion" not in last
    assert last["rmse"] == pytest.approx(last["loss"] ** 0.5)
    assert out["he"] is None  # HE scoring is off for regression
    m = out["masking"]
    assert m["class_names"] == [] and m["train_class_counts"] == [] and m["columns"]["loss_amount"] == "keep"
    html = (run_dir / "report.html").read_text()
    assert "RMSE" in html and "Confusion matrix" not in html and "classes (id: name)" not in html
    # Identifiers never reach the report's text (embedded images are base64, where any three
    # characters such as "C00" turn up by chance: the test failed on a training-curve PNG).
    text = re.sub(r"data:image/[a-z]+;base64,[A-Za-z0-9+/=]+", "", html)
    assert "Person Number" not in text and "C00" not in text
    assert "Person Number" not in (run_dir / "data" / "train.parquet").read_bytes().decode("latin-1")
    # The signed provenance carries the regression metric, which a release policy can gate on.
    import base64

    from securetrain.release.gate import ReleasePolicy, _check_metric

    envelope = json.loads((run_dir / "release" / "provenance.dsse.json").read_text())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    best = statement["predicate"]["validation"]["best"]
    assert best["metric"] == "rmse" and best["value"] == pytest.approx(t["best"]["value"])
    for bound, ok in ((best["value"] + 1.0, True), (best["value"] / 2, False)):
        failures: list[str] = []
        _check_metric(ReleasePolicy(min_validation={"metric": "rmse", "value": bound}), statement, failures)
        assert (failures == []) is ok, failures
    failures = []
    _check_metric(ReleasePolicy(min_validation={"metric": "auc", "value": 0.5}), statement, failures)
    assert failures == ["validation: the statement has no 'auc' metric"]  # a classifier's gate refuses it


def test_targets_are_floats_and_the_model_has_one_output(tmp_path: Path) -> None:
    from securetrain.pipeline import stages
    from securetrain.pipeline.secrets import load_run_secrets

    config = load_pipeline_config(data=_config(tmp_path))
    assert config.he.enabled is False and config.training.validation.metric == "rmse"
    secrets = load_run_secrets(config)
    stages.prepare(config, stages.ingest(config), secrets)
    _, data = stages.task_datasets(config, secrets)
    assert data.regression and data.num_outputs == 1 and data.class_names is None
    item = data.train[0]
    assert item["label"].dtype == torch.float32
    labels = torch.stack([data.train[i]["label"] for i in range(len(data.train))])
    assert not torch.equal(labels, labels.round())  # decimal amounts, not class ids
    model = stages.build_task_model(config, data)
    assert model(item["features"].unsqueeze(0)).shape == (1, 1)


def test_a_target_on_a_1e5_scale_trains_to_a_sensible_rmse_in_its_own_units(tmp_path: Path) -> None:
    """Prices: std ~1.2e5 around 3e5. MSE on raw targets of that size barely moves a small MLP; with
    the targets standardised on the training split the RMSE is a fraction of the target's std, and
    the report, the scaling and the model's restored predictions are all in the target's units."""
    from securetrain.pipeline import stages
    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.pipeline.target_scaling import load_target_scaling

    data = _config(tmp_path, training={"epochs": 12, "log_every": 10})
    data["data"]["source"] = str(_claims_csv(tmp_path / "prices.csv", scale=1000.0, offset=3e5))
    config = load_pipeline_config(data=data)
    result = run_pipeline(config)
    t = result.training
    secrets = load_run_secrets(config)
    _, split = stages.task_datasets(config, secrets)
    train_y = split.train.labels.double()
    eval_y = split.eval.labels.double()
    assert t.target_scaling is not None and t.target_scaling["method"] == "standard"
    assert t.target_scaling["mean"] == pytest.approx(float(train_y.mean()), rel=1e-6)  # training split only
    assert t.target_scaling["std"] == pytest.approx(float(train_y.std(unbiased=False)), rel=1e-6)
    assert t.target_scaling["samples"] == len(split.train)
    std = float(eval_y.std(unbiased=False))
    assert std > 5e4
    best = t.best
    assert best is not None and best["metric"] == "rmse"
    assert best["value"] < 0.5 * std, (best["value"], std)  # learnt, not the mean predictor (rmse ~ std)
    # The reported RMSE is the restored predictions' error in the target's own units.
    scaling = load_target_scaling(config.run_dir)
    assert scaling is not None and scaling.to_dict() == t.target_scaling
    model = stages.load_trained_model(config, secrets, None, split, which="best")
    with torch.no_grad():
        predictions = scaling.restore(model(split.eval.features).squeeze(1)).double()
    rmse = float(((predictions - eval_y) ** 2).mean().sqrt())
    assert rmse == pytest.approx(best["value"], rel=1e-4)
    assert abs(float(predictions.mean()) - float(eval_y.mean())) < 0.5 * std  # in prices, not z-scores
    page = result.report_html.read_text()
    assert "standardised" in page and f"{t.target_scaling['mean']:.6g}" in page
    # The signed provenance says how the released weights' outputs become prices.
    import base64

    envelope = json.loads((config.run_dir / "release" / "provenance.dsse.json").read_text())
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["predicate"]["model"]["targetScaling"] == t.target_scaling


def test_he_scores_a_regression_model_in_the_targets_units(tmp_path: Path) -> None:
    """HE scoring of a price model: the decrypted outputs are un-standardised; RMSE/MAE of the
    encrypted and the plaintext predictions against the held-out prices, and the encrypted
    predictions' RMSE against the plaintext ones (CKKS noise), all in the target's units."""
    data = _config(tmp_path, training={"epochs": 12, "log_every": 10}, he={"enabled": True})
    data["data"]["source"] = str(_claims_csv(tmp_path / "prices.csv", scale=1000.0, offset=3e5))
    config = load_pipeline_config(data=data)
    result = run_pipeline(config)
    h, t = result.he, result.training
    assert h is not None and t.best is not None and t.target_scaling is not None
    assert h.task_kind == "regression" and h.outputs == 1 and h.scope == "head"  # the MLP's hidden ReLU: head
    assert h.encrypted_auc is None and h.plaintext_auc is None and h.prediction_agreement is None
    # The plaintext predictions are the best checkpoint's validation, in prices.
    assert h.rmse_plaintext == pytest.approx(t.best["value"], rel=1e-4)
    best = next(v for v in t.validation if v["epoch"] == t.best["epoch"])
    assert h.mae_plaintext == pytest.approx(best["mae"], rel=1e-4)
    std = t.target_scaling["std"]
    assert h.rmse_vs_plaintext is not None and 0 <= h.rmse_vs_plaintext < 1e-3 * std  # CKKS noise, in prices
    assert h.max_abs_error < 1e-2 * std and h.max_abs_error >= h.rmse_vs_plaintext
    assert h.rmse_encrypted == pytest.approx(h.rmse_plaintext, abs=h.rmse_vs_plaintext + 1e-9)
    page = result.report_html.read_text()
    assert "RMSE plaintext / encrypted" in page and "AUC plaintext" not in page
    out = json.loads((config.run_dir / "result.json").read_text())["he"]
    assert out["task_kind"] == "regression" and out["rmse_encrypted"] == pytest.approx(h.rmse_encrypted)


def _release_policy(folder: Path) -> tuple[Path, Path]:
    """A release policy with one approver (its private key returned too), no DP, any RMSE."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    folder.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private = folder / "ann.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    (folder / "ann.pub.pem").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    policy = folder / "release.yaml"
    policy.write_text(yaml.safe_dump({"max_epsilon": None, "min_validation": {"metric": "rmse", "value": 1e12},
                                      "approvals": {"required": 1,
                                                    "approvers": [{"name": "ann", "public_key": "ann.pub.pem"}]}}))
    return policy, private


def test_the_released_weights_predict_in_the_targets_units(tmp_path: Path) -> None:
    """A user loads the released model.safetensors into the model built from its spec and runs it:
    prices, not z-scores. Its errors are the ones the run reported (best checkpoint's RMSE/MAE) and
    the ones the HE stage scored in plaintext, and the signed provenance says what was done."""
    from safetensors.torch import load_file

    from securetrain.pipeline import stages
    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.release.gate import approve, release

    pytest.importorskip("tenseal", reason="the HE stage needs tenseal ([he] extra)")
    data = _config(tmp_path, training={"epochs": 3, "log_every": 10}, he={"enabled": True})
    data["data"]["source"] = str(_claims_csv(tmp_path / "prices.csv", scale=1000.0, offset=3e5))
    config = load_pipeline_config(data=data)
    result = run_pipeline(config)
    t, h = result.training, result.he
    assert t.best is not None and t.target_scaling is not None and h is not None
    policy, key = _release_policy(tmp_path / "approvers")
    approve(config.run_dir, key, policy_path=policy)
    out = tmp_path / "deploy" / "model.safetensors"
    release(config.run_dir, out, policy_path=policy)

    _, split = stages.task_datasets(config, load_run_secrets(config))
    model = stages.build_task_model(config, split)  # model.target + model.kwargs, as the user builds it
    model.load_state_dict(load_file(out), strict=True)
    with torch.no_grad():
        predictions = model.eval()(split.eval.features).squeeze(1).double()
    eval_y = split.eval.labels.double()
    rmse = float(((predictions - eval_y) ** 2).mean().sqrt())
    mae = float((predictions - eval_y).abs().mean())
    best = next(v for v in t.validation if v["epoch"] == t.best["epoch"])
    assert rmse == pytest.approx(t.best["value"], rel=1e-4) and mae == pytest.approx(best["mae"], rel=1e-4)
    assert h.rmse_plaintext == pytest.approx(rmse, rel=1e-4) and h.mae_plaintext == pytest.approx(mae, rel=1e-4)
    std = t.target_scaling["std"]
    assert abs(float(predictions.mean()) - float(eval_y.mean())) < 0.5 * std  # prices, not z-scores
    # The signed statement: the scaling as trained, and how it went into the released weights.
    import base64

    envelope = json.loads((config.run_dir / "release" / "provenance.dsse.json").read_text())
    model_record = json.loads(base64.b64decode(envelope["payload"]))["predicate"]["model"]
    assert model_record["targetScaling"] == t.target_scaling
    assert model_record["releasedOutputs"]["units"] == "target"
    assert model_record["releasedOutputs"]["method"] == "folded"
    assert model_record["releasedOutputs"]["layer"] == "head"


def test_target_scaling_none_trains_on_the_raw_targets(tmp_path: Path) -> None:
    config = load_pipeline_config(data=_config(tmp_path, data={"target_scaling": "none"}))
    result = run_pipeline(config)
    assert result.training.target_scaling is None
    assert json.loads((config.run_dir / "result.json").read_text())["training"]["target_scaling"] is None
    from securetrain.pipeline.target_scaling import load_target_scaling

    assert load_target_scaling(config.run_dir) is None


@pytest.mark.parametrize(("first", "then"), [("none", "standard"), ("standard", "none")])
def test_a_resumed_run_keeps_the_scaling_its_checkpoints_were_trained_with(tmp_path: Path, first: str,
                                                                          then: str) -> None:
    """Checkpoints trained on raw targets (a run before target scaling, or target_scaling: none) are
    not continued on standardised ones, nor the reverse: the run's own record decides, not the config."""
    from securetrain.pipeline.target_scaling import load_target_scaling

    one = run_pipeline(load_pipeline_config(data=_config(tmp_path, data={"target_scaling": first})))
    config = load_pipeline_config(data=_config(tmp_path, data={"target_scaling": then}, training={"epochs": 2}))
    again = run_pipeline(config)
    assert again.training.resumed_from == one.training.steps and again.training.steps > one.training.steps
    assert (again.training.target_scaling is None) == (first == "none")
    assert (load_target_scaling(config.run_dir) is None) == (first == "none")
    assert again.training.target_scaling == one.training.target_scaling


def test_non_finite_or_non_numeric_targets_are_refused(tmp_path: Path) -> None:
    values = [f"{i / 10:.1f}" for i in range(240)]
    for name, bad, match in (("inf", "inf", r"non-finite value\(s\)"), ("nan", "nan", r"loss_amount.*(empty|non-finite)"),
                             ("text", "high", r"not numeric")):
        tmp = tmp_path / name
        tmp.mkdir()
        data = _config(tmp)
        target = list(values)
        target[7] = bad
        data["data"]["source"] = str(_claims_csv(tmp / "bad.csv", target=target))
        with pytest.raises(TaskError, match=match):
            run_pipeline(load_pipeline_config(data=data))
        assert not (tmp / "runs" / "claims" / "checkpoints").exists()  # refused before training


def test_regression_config_refusals(tmp_path: Path) -> None:
    assert load_pipeline_config(data=_config(tmp_path, he={"enabled": True})).he.enabled  # opt-in HE scoring
    with pytest.raises(ConfigError, match=r"data.classes: a regression task has no classes"):
        load_pipeline_config(data=_config(tmp_path, data={"classes": ["a", "b"]}))
    explicit = load_pipeline_config(data=_config(tmp_path, training={"validation": {"metric": "mae"}}))
    assert explicit.training.validation.metric == "mae" and not explicit.training.validation.maximize
    from securetrain.pipeline.stages import preflight

    with pytest.raises(ConfigError, match=r"'auc' is not a validation metric of this task"):
        preflight(load_pipeline_config(data=_config(tmp_path, training={"validation": {"metric": "auc"}})))


def test_classification_still_refuses_decimal_labels_and_points_to_regression(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"non-integer numbers"):
        run_pipeline(load_pipeline_config(data=_config(tmp_path, task="tabular-classification")))


CUSTOM_TASK = '''
import torch
from torch.utils.data import TensorDataset

from securetrain.pipeline.tasks import TaskData


class Line:
    """y = 2x + 1 on 4 features (float targets, no classes)."""

    def __init__(self, kind="regression", model_facts=None):
        self.kind, self.facts = kind, model_facts

    def build_datasets(self, ctx):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = 2 * x[:, 0] + 1
        return TaskData(TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), kind=self.kind,
                        model_facts=self.facts or {"in_features": 4})


def build(in_features, num_outputs):
    return torch.nn.Linear(in_features, num_outputs)


def wide(in_features):
    return torch.nn.Linear(in_features, 3)
'''


def _custom(tmp: Path, **sections: Any) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "linetask.py").write_text(CUSTOM_TASK)
    data: dict[str, Any] = {
        "name": "line", "output_dir": str(tmp / "runs"),
        "task": {"target": "linetask:Line"},
        "model": {"target": "linetask:build"},
        "training": {"epochs": 2, "batch_size": 16, "lr": 0.05, "checkpoint_every": 100},
        "he": {"enabled": False},
        "secrets": {"create_demo_secrets": True},
        "base_dir": str(tmp),
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def test_custom_regression_task(tmp_path: Path) -> None:
    result = run_pipeline(load_pipeline_config(data=_custom(tmp_path)))
    t = result.training
    assert t.task_kind == "regression" and t.validation_metric == "rmse" and t.best is not None
    assert t.validation[-1]["rmse"] < t.validation[0]["rmse"] or t.validation[-1]["rmse"] < 2.5


def test_custom_regression_he_scoring_and_a_wide_model(tmp_path: Path) -> None:
    result = run_pipeline(load_pipeline_config(data=_custom(tmp_path / "a", he={"enabled": True})))
    h = result.he
    assert h is not None and h.task_kind == "regression" and h.scope == "head" and h.encrypted_auc is None
    assert h.rmse_vs_plaintext is not None and h.rmse_vs_plaintext < 1e-3
    assert h.rmse_encrypted == pytest.approx(h.rmse_plaintext, abs=1e-3)
    with pytest.raises(ConfigError, match=r"'accuracy' is not a validation metric of a regression task"):
        run_pipeline(load_pipeline_config(data=_custom(tmp_path / "c", training={"validation": {"metric": "accuracy"}})))
    with pytest.raises(ModelOutputError, match=r"regression, so it must return \[2, 1\]"):
        run_pipeline(load_pipeline_config(data=_custom(tmp_path / "b", model={"target": "linetask:wide"})))


def test_custom_task_without_class_names_must_say_regression(tmp_path: Path) -> None:
    from securetrain.pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match=r"without class_names"):
        run_pipeline(load_pipeline_config(data=_custom(tmp_path, task={"target": "linetask:Line",
                                                                         "kwargs": {"kind": "classification"}})))

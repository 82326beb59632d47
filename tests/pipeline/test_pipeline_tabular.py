"""tabular-classification / examples/finance.yaml end to end without Prefect:
mask -> split by customer token -> encode (fitted on train) -> MLP -> HE scoring -> sealed audit."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from typer.testing import CliRunner

from securetrain.cli.main import app
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.errors import TaskError
from securetrain.pipeline.runner import run_pipeline

from .pipeline_fixtures import finance_config, finance_pii, scan_for

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")


@pytest.fixture(scope="module")
def finance_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("finance")
    config_file = tmp / "finance.yaml"
    config_file.write_text(yaml.safe_dump(finance_config(tmp)))
    result = CliRunner().invoke(app, ["run", str(config_file), "--no-prefect"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    run_dir = tmp / "runs" / "fin"
    return run_dir, json.loads((run_dir / "result.json").read_text())


def test_every_stage_of_the_finance_pipeline(finance_run) -> None:
    run_dir, result = finance_run
    m, t, he = result["masking"], result["training"], result["he"]
    assert result["task"] == "tabular-classification" and result["deid"] is None
    assert m["policy"] == "finance-pii" and m["rows_in"] == 600 and m["train_rows"] + m["eval_rows"] == 600
    assert m["columns"]["customer_id"] == "tokenize" and m["columns"]["notes"] == "drop"
    assert set(m["feature_columns"]) == {"amount", "balance", "txn_date", "category", "hour"}  # never identifier tokens
    assert t["model_target"] == "logistic" and t["class_names"] == ["0", "1"] and len(t["validation"]) >= 1
    assert all(v["auc"] is not None for v in t["validation"])
    assert he["scope"] == "model" and he["samples"] == m["eval_rows"] and he["max_abs_error"] < 1e-3
    # Exact up to CKKS noise (~1e-5): at most a score sitting on the threshold or a tie may move.
    assert abs(he["encrypted_accuracy"] - he["plaintext_accuracy"]) <= 1 / he["samples"]
    assert he["encrypted_auc"] == pytest.approx(he["plaintext_auc"], abs=2e-3)
    assert result["audit"]["verified"] is True


def test_no_customer_on_both_sides(finance_run) -> None:
    run_dir, result = finance_run
    train = set(pq.read_table(run_dir / "data" / "train.parquet").column("customer_id").to_pylist())
    evaluation = set(pq.read_table(run_dir / "data" / "eval.parquet").column("customer_id").to_pylist())
    assert train and evaluation and not (train & evaluation)
    assert len(train) == result["masking"]["train_entities"] and len(evaluation) == result["masking"]["eval_entities"]
    assert all(str(v).startswith("tok_") for v in train)  # pseudonyms, not customer ids


def test_no_pii_in_any_output(finance_run) -> None:
    run_dir, _ = finance_run
    pii = finance_pii(run_dir / "raw" / "transactions.parquet")
    assert len(pii) > 500
    assert scan_for(run_dir, pii) > 15


def test_audit_records_masking_and_training(finance_run) -> None:
    from securetrain.pipeline.runner import open_run_audit

    run_dir, _ = finance_run
    config = load_pipeline_config(data=finance_config(run_dir.parents[1]))
    with open_run_audit(config) as log:
        actions = {e.action for e in log.entries()}
        assert log.verify().ok
    assert {"pipeline.start", "tabular.read", "mask.policy_applied", "training.start", "checkpoint.write",
            "he.evaluate", "pipeline.stop"} <= actions


def test_encoder_is_fitted_on_the_training_split_only() -> None:
    from securetrain.pipeline.tasks.tabular import TableEncoder

    train = pa.table({"amount": [1.0, 3.0, None], "category": ["a", "b", "a"]})
    other = pa.table({"amount": [2.0, 100.0, None], "category": ["a", "zzz", None]})
    enc = TableEncoder(["amount", "category"], max_categories=1).fit(train)
    assert enc.numeric["amount"] == (2.0, 1.0) and enc.categories["category"] == ["a"]  # top-1 of the train split
    x = enc.transform(other)
    assert x.shape == (3, 3) and enc.feature_names == ["amount", "category=a", "category=<other>"]
    assert torch.equal(x[:, 0], torch.tensor([0.0, 98.0, 0.0]))  # train mean/std; missing -> the mean
    assert x[:, 1:].tolist() == [[1, 0], [0, 1], [0, 1]]  # unseen and missing -> other


def _with_table(tmp_path: Path, table: pa.Table, **data) -> object:  # noqa: ANN003
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "table.parquet"
    pq.write_table(table, source)
    cfg = finance_config(tmp_path, data={"source": str(source), **data}, he={"enabled": False})
    return load_pipeline_config(data=cfg)


def test_unknown_column_fails_closed_before_training(tmp_path: Path) -> None:
    from securetrain.masking.tabular import UnmaskedColumnError, generate_finance_table

    table = generate_finance_table(50, seed=0)
    table = table.append_column("passport_no", pa.array(["X1234567"] * 50))
    config = _with_table(tmp_path, table)
    with pytest.raises(UnmaskedColumnError, match="passport_no"):
        run_pipeline(config)
    assert not list(config.run_dir.rglob("*.parquet")) and not list(config.run_dir.rglob("*.stenc"))


def test_split_column_must_be_tokenised_and_label_kept(tmp_path: Path) -> None:
    from securetrain.masking.tabular import generate_finance_table
    from securetrain.pipeline.tasks.tabular import _entity_column

    # Without data.split_by the entity is the one tokenised *_id column; ambiguity is refused.
    assert _entity_column({"customer_id": "tokenize", "iban": "tokenize", "amount": "keep"}, "p") == "customer_id"
    with pytest.raises(TaskError, match=r"tokenised id columns: customer_id, account_id"):
        _entity_column({"customer_id": "tokenize", "account_id": "tokenize"}, "p")
    with pytest.raises(TaskError, match=r"tokenised id columns: none"):
        _entity_column({"customer_id": "keep"}, "p")
    table = generate_finance_table(60, seed=0)
    with pytest.raises(TaskError, match=r"split_by: column 'category' is 'keep'.*must be tokenised"):
        run_pipeline(_with_table(tmp_path / "a", table, split_by="category"))
    with pytest.raises(TaskError, match=r"label_column 'notes' is not kept"):
        run_pipeline(_with_table(tmp_path / "b", table, label_column="notes"))
    inferred = run_pipeline(_with_table(tmp_path / "c", table, split_by=None))
    assert inferred.masking.split_by == "customer_id" and inferred.training.steps > 0


def test_he_auto_scope_is_exact_for_a_model_with_hidden_activations(tmp_path: Path) -> None:
    # An MLP's hidden ReLUs would be polynomials under CKKS (encrypted accuracy then differs from
    # the model's): the default scope scores its last linear layer instead, exactly.
    config = load_pipeline_config(data=finance_config(
        tmp_path, name="mlp", model={"target": "mlp", "kwargs": {"hidden": [8]}}, he={"scope": "auto"},
        training={"epochs": 2}))
    he = run_pipeline(config).he
    assert he is not None and he.scope == "head" and he.max_abs_error < 1e-3
    assert abs(he.encrypted_accuracy - he.plaintext_accuracy) <= 1 / he.samples


def test_only_hidden_activations_count_as_approximated() -> None:
    from torch import nn

    from securetrain.pipeline.stages import _approximated_activations

    assert _approximated_activations(nn.Sequential(nn.Linear(3, 1))) == []
    assert _approximated_activations(nn.Sequential(nn.Linear(3, 1), nn.Sigmoid(), nn.Dropout())) == []
    assert _approximated_activations(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))) == []
    assert _approximated_activations(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(), nn.Linear(4, 2))) == ["ReLU"]
    assert _approximated_activations(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1), nn.Sigmoid())) == ["Tanh"]


@pytest.mark.parametrize("labels", [
    pa.array([float(i % 2) for i in range(59)] + [float("nan")], pa.float64()),  # Parquet float label, one NaN
    pa.array(["yes" if i % 2 else "no" for i in range(58)] + ["", "  "]),  # blank text labels
])
def test_nan_or_blank_labels_are_refused_not_a_class(tmp_path: Path, labels: pa.Array) -> None:
    # A NaN in a float label column used to become its own class "nan" (a 3-class model trained on
    # a missing value), and a blank string the class "": both are missing labels, refused like nulls.
    from securetrain.masking.tabular import generate_finance_table

    table = generate_finance_table(60, seed=0)
    table = table.set_column(table.column_names.index("label"), "label", labels)
    config = _with_table(tmp_path, table)
    with pytest.raises(TaskError, match=r"the label column has [12] missing value\(s\) \(empty, blank or NaN\)"):
        run_pipeline(config)
    assert not list(config.run_dir.rglob("*.parquet")) and not list(config.run_dir.rglob("*.stenc"))


def test_rerun_on_a_changed_table_is_refused_not_resumed(tmp_path: Path) -> None:
    # The same run folder, the same number of rows, other labels: the rerun resumed the checkpoints
    # trained on the old table and reported the model as trained on the new one.
    from securetrain.masking.tabular import generate_finance_table
    from securetrain.training.errors import ResumeMismatchError

    table = generate_finance_table(80, seed=0)
    config = _with_table(tmp_path, table)
    config.training.epochs = 1
    first = run_pipeline(config)
    assert first.training.steps > 0
    flipped = pa.array(["1" if str(v) == "0" else "0" for v in table.column("label").to_pylist()])
    pq.write_table(table.set_column(table.column_names.index("label"), "label", flipped), tmp_path / "table.parquet")
    with pytest.raises(ResumeMismatchError, match=r"the training data differ from the data its checkpoints"):
        run_pipeline(config)
    pq.write_table(table, tmp_path / "table.parquet")  # the original table again: resumes (nothing left to train)
    assert run_pipeline(config).training.resumed_from == first.training.steps


def test_a_class_without_training_rows_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A class the training split never shows (listed in data.classes, or only held out) trained a
    # model that cannot predict it, without a word.
    import logging

    from securetrain.masking.tabular import generate_finance_table
    from securetrain.pipeline import stages
    from securetrain.pipeline.secrets import load_run_secrets

    config = _with_table(tmp_path, generate_finance_table(60, seed=0), classes=["0", "1", "2"])
    with caplog.at_level(logging.WARNING, logger="securetrain.pipeline"):
        prepared = stages.prepare(config, config.data.source, load_run_secrets(config))
    assert prepared.masking.train_class_counts[2] == 0
    warned = [r.getMessage() for r in caplog.records if "no training" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "1 of 3 class(es) have no training rows, so the model cannot learn them: '2' (0 held out)"), warned

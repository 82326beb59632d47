"""Done-when of issue 13: a user's model package outside the repository, named only in a config,
trains on a labelled 3-class DICOM set through `securetrain run CONFIG --no-prefect`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from securetrain.cli.main import app

from .pipeline_fixtures import CLASS_NAMES, byom_config, scan_for, three_class_dicom, write_user_model

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("byom")
    config_dir = tmp / "project"  # outside the repository; the package sits next to the config
    write_user_model(config_dir)
    source = three_class_dicom(tmp / "studies")
    config_file = config_dir / "run.yaml"
    config_file.write_text(yaml.safe_dump(byom_config(tmp, source)))
    assert "mynets" not in sys.modules
    result = CliRunner().invoke(app, ["run", str(config_file), "--no-prefect"])
    sys.modules.pop("mynets", None)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return tmp, config_file, tmp / "runs" / "byom", result.output


def test_result_json_holds_the_whole_run(cli_run) -> None:
    _, _, run_dir, output = cli_run
    result = json.loads((run_dir / "result.json").read_text())
    t = result["training"]
    assert t["model_target"] == "mynets:build" and t["parameters"] == 4 * 1 * 9 + 4 + 16 * 3 + 3
    assert t["class_names"] == sorted(CLASS_NAMES)  # string labels -> stable ids (sorted)
    assert result["label_map"] == {"benign": 0, "malignant": 1, "normal": 2} == t["label_map"]
    assert result["model_target"] == "mynets:build" and result["parameter_count"] == t["parameters"]
    assert result["validation"] == t["validation"] and len(result["checkpoint_paths"]) == len(t["checkpoints"]) + 1
    assert len(t["validation"]) == 3 and [v["epoch"] for v in t["validation"]] == [1, 2, 3]
    for v in t["validation"]:
        assert {"loss", "accuracy", "auc", "class_counts", "confusion"} <= set(v)
        assert len(v["class_counts"]) == 3 and sum(v["class_counts"]) == result["deid"]["eval_files"] > 0
    assert t["best"]["metric"] == "accuracy" and t["best_checkpoint"]["path"].endswith(".stenc")
    assert t["checkpoints"] and all(c["path"].endswith(".stenc") for c in t["checkpoints"])
    assert result["he"]["outputs"] == 3 and result["he"]["max_abs_error"] < 1e-3
    he = result["he"]  # arg-max after decryption: only a near-tie of two class scores could move
    assert abs(he["encrypted_accuracy"] - he["plaintext_accuracy"]) <= 1 / he["samples"]
    assert result["audit"]["verified"] is True
    assert "run result" in output and "validation" in output


def test_no_patient_on_both_sides_of_the_split(cli_run) -> None:
    import csv

    import pydicom

    _, _, run_dir, _ = cli_run
    deid = run_dir / "deid"

    def patients(split: str) -> set[str]:
        rows = list(csv.DictReader((deid / f"{split}.csv").open()))
        assert rows and all(row["label"] in {"0", "1", "2"} for row in rows)
        return {str(pydicom.dcmread(deid / row["path"], stop_before_pixels=True).PatientID) for row in rows}

    train, evaluation = patients("train"), patients("eval")
    assert train and evaluation and not (train & evaluation)


def test_user_tensors_are_in_the_encrypted_checkpoint_under_their_own_names(cli_run) -> None:
    from securetrain.crypto.checkpoint import EncryptedCheckpointStore
    from securetrain.pipeline.config import load_pipeline_config
    from securetrain.pipeline.secrets import load_run_secrets

    _, config_file, run_dir, _ = cli_run
    config = load_pipeline_config(config_file)
    keyring = load_run_secrets(config).keyring
    for folder in (run_dir / "checkpoints", run_dir / "checkpoints" / "best"):
        latest = max(folder.glob("*.stenc"))
        assert b"classifier.weight" not in latest.read_bytes()  # names are inside the ciphertext too
        loaded = EncryptedCheckpointStore(folder, keyring).load()
        names = {k for k in loaded.tensors if k.startswith("model/")}
        assert names == {"model/encoder.0.weight", "model/encoder.0.bias", "model/classifier.weight", "model/classifier.bias"}
        assert loaded.tensors["model/classifier.weight"].shape == (3, 16)


def test_report_shows_curves_confusion_and_model_card(cli_run) -> None:
    _, _, run_dir, _ = cli_run
    html = (run_dir / "report.html").read_text()
    assert "Model card" in html and "mynets:build" in html and "Confusion matrix" in html
    assert all(name in html for name in CLASS_NAMES) and "sha256 train_manifest" in html
    assert (run_dir / "training-curve.png").read_bytes()[:4] == b"\x89PNG"


def test_no_planted_phi_in_any_output(cli_run) -> None:
    tmp, _, run_dir, _ = cli_run
    phi = json.loads((tmp / "studies" / "phi.json").read_text())
    values = {v.encode() for kind in ("text", "dates", "uids") for v in phi["all"].get(kind, []) if len(v) >= 6}
    assert len(values) > 50
    assert scan_for(run_dir, values) > 20


def test_integer_labels_and_declared_classes(tmp_path: Path) -> None:
    from securetrain.pipeline.tasks.base import canonical_label, label_names
    from securetrain.pipeline.errors import TaskError

    assert label_names(["10", "2", "1"], None, where="m") == ["1", "2", "10"]  # numeric, not lexical
    assert canonical_label(" 02 ") == "2" and canonical_label("Benign") == "Benign"
    assert label_names(["a"], ["b", "a", "c"], where="m") == ["b", "a", "c"]  # declared order wins
    with pytest.raises(TaskError, match="not in data.classes"):
        label_names(["a", "z"], ["a", "b"], where="m")


def test_declared_classes_are_canonical_like_the_labels() -> None:
    """data.classes follows the labels' rules: integer classes may be written as YAML integers, and
    "01" is "1" there as in the manifest (it was refused: every label 'not in data.classes')."""
    from securetrain.pipeline.config import DataConfig
    from securetrain.pipeline.errors import TaskError
    from securetrain.pipeline.tasks.base import canonical_label, label_names

    assert DataConfig(classes=[2, 0, 1]).classes == ["2", "0", "1"]
    assert DataConfig(classes=[" 02", "x"]).classes == ["2", "x"]
    labels = [canonical_label(v) for v in ["01", "02", "01"]]
    assert label_names(labels, ["02", "01"], where="m") == ["2", "1"]
    with pytest.raises(ValueError, match="more than once"):
        DataConfig(classes=["1", "01"])
    with pytest.raises(TaskError, match="more than once"):
        label_names(["a"], ["a", "a"], where="m")

"""A production-shaped run (secrets from the environment, no demo secrets) as the operations docs
describe it: what it needs is checked before any work, and user data it cannot train on is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from securetrain.pipeline import load_pipeline_config, run_pipeline
from securetrain.pipeline.errors import SigningKeyError
from tests.pipeline.pipeline_fixtures import small_config_data


@pytest.fixture
def production_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from securetrain.audit.keys import load_or_create_signing_key

    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_PROVENANCE_KEY",
                "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", os.urandom(32).hex())
    monkeypatch.setenv("SECURETRAIN_DEID_KEY", os.urandom(32).hex())
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    load_or_create_signing_key(keys / "audit.pem")
    monkeypatch.setenv("SECURETRAIN_AUDIT_KEY", str(keys / "audit.pem"))
    return keys


def test_missing_provenance_key_fails_before_any_work(tmp_path: Path, production_env: Path) -> None:
    config = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False}))
    with pytest.raises(SigningKeyError) as info:
        run_pipeline(config)
    message = str(info.value)
    assert "provenance signing key not found" in message and "securetrain release keygen" in message
    assert "SECURETRAIN_PROVENANCE_KEY" in message and "release.provenance: false" in message
    assert not (config.run_dir / "raw").exists() and not (config.run_dir / "checkpoints").exists()


def test_unsafe_provenance_key_is_named_as_such(tmp_path: Path, production_env: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.pipeline.secrets import check_provenance_key

    key = production_env / "prov.pem"
    key.write_text("not a key")
    key.chmod(0o644)
    monkeypatch.setenv("SECURETRAIN_PROVENANCE_KEY", str(key))
    config = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False}))
    with pytest.raises(SigningKeyError, match="provenance signing key .* readable by others"):
        check_provenance_key(config)
    key.chmod(0o600)
    with pytest.raises(SigningKeyError, match="provenance signing key .* not an unencrypted PEM"):
        check_provenance_key(config)
    off = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False},
                                                      release={"provenance": False}))
    check_provenance_key(off)  # not needed, not checked


@pytest.mark.postgres
def test_audit_verify_names_the_schema_it_looked_in(pg_schema: str) -> None:
    """A run's log lives in its audit.schema: verifying without --schema says where it looked."""
    from securetrain.audit.errors import AuditConfigError
    from securetrain.audit.log import AuditLog
    from tests.conftest import POSTGRES_URL

    with pytest.raises(AuditConfigError) as info:
        AuditLog(POSTGRES_URL, schema=pg_schema, create=False)
    assert repr(pg_schema) in str(info.value) and "--schema" in str(info.value)


# --------------------------------------------------------------- a finance team's own table and model
USER_TABLE_MODEL = '''
from torch import nn


def build(in_features, num_classes, hidden=8):
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
'''

LOANS_POLICY = '''
policy_version: "1.0.0"
name: loans
columns:
  - {name: customer_id, action: tokenize, domain: customer}
  - {name: full_name, action: tokenize, domain: person}
  - {name: amount, action: keep}
  - {name: segment, action: keep}
  - {name: defaulted, action: keep}
  - {name: risk, action: keep}
  - {name: loss, action: keep}
'''


def write_loans_project(folder: Path, rows: int = 160) -> Path:
    """A team's project folder: their CSV (not the repository's generator), policy and model."""
    import csv
    import random

    rnd = random.Random(3)
    folder.mkdir(parents=True)
    with open(folder / "loans.csv", "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(["customer_id", "full_name", "amount", "segment", "defaulted", "risk", "loss"])
        for _ in range(rows):
            cid = rnd.randrange(40)
            amount = round(rnd.uniform(1, 500), 2)
            out.writerow([f"C{cid:04d}", f"Person {cid}", amount, rnd.choice(["retail", "sme"]),
                          "yes" if amount > 300 else "no", ["low", "mid", "high"][min(int(amount // 170), 2)],
                          round(amount * 0.1 + rnd.gauss(0, 1), 3)])
    (folder / "policy.yaml").write_text(LOANS_POLICY)
    (folder / "loanmodels.py").write_text(USER_TABLE_MODEL)
    return folder


def loans_config(folder: Path, label: str, **sections: object) -> Path:
    import yaml

    data = {
        "name": f"loans-{label}", "output_dir": str(folder / "runs"), "task": "tabular-classification",
        "data": {"source": "loans.csv", "policy": "policy.yaml", "label_column": label, "split_by": "customer_id"},
        "model": {"target": "loanmodels:build", "kwargs": {"hidden": 4}},
        "training": {"epochs": 1, "batch_size": 32},
        "he": {"enabled": False}, "release": {"provenance": False},
        "secrets": {"create_demo_secrets": True},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value  # type: ignore[dict-item]
    path = folder / f"{label}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_own_csv_with_string_and_multiclass_targets(tmp_path: Path) -> None:
    project = write_loans_project(tmp_path / "project")
    binary = run_pipeline(load_pipeline_config(loans_config(project, "defaulted")))
    assert binary.training.class_names == ["no", "yes"]
    three = run_pipeline(load_pipeline_config(loans_config(project, "risk")))
    assert three.training.class_names == ["high", "low", "mid"]
    assert three.training.model_target == "loanmodels:build"


def test_regression_target_is_refused_before_training(tmp_path: Path) -> None:
    from securetrain.pipeline.errors import TaskError

    project = write_loans_project(tmp_path / "project")
    config = load_pipeline_config(loans_config(project, "loss"))
    with pytest.raises(TaskError, match="non-integer numbers") as info:
        run_pipeline(config)
    assert "classifiers only" in str(info.value) and "data.classes" in str(info.value)
    assert not (config.run_dir / "checkpoints").exists()


def test_label_names_refuse_fractional_numbers_only() -> None:
    from securetrain.pipeline.errors import TaskError
    from securetrain.pipeline.tasks.base import label_names

    assert label_names(["0.0", "1.0"], None, where="t") == ["0.0", "1.0"]  # integral: classes as before
    assert label_names(["10", "2"], None, where="t") == ["2", "10"]
    assert label_names(["a", "1.5"], None, where="t") == ["1.5", "a"]  # not all numbers: names
    assert label_names(["0.5", "1.5"], ["0.5", "1.5"], where="t") == ["0.5", "1.5"]  # listed: class names
    with pytest.raises(TaskError, match="non-integer"):
        label_names(["0.5", "1", "2.25"], None, where="t")


def test_tabular_run_needs_only_the_masking_key(tmp_path: Path, production_env: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """finance.md: the masking key is SECURETRAIN_MASK_KEY, or derived from SECURETRAIN_DEID_KEY.
    A finance team that sets only the masking key is not asked for a DICOM de-identification key."""
    from securetrain.masking.dicom.errors import DeidKeyError

    monkeypatch.delenv("SECURETRAIN_DEID_KEY")
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", "")  # recorded, so the value the *_FILE sets is undone
    monkeypatch.delenv("SECURETRAIN_MASK_KEY")
    project = write_loans_project(tmp_path / "project")
    config = load_pipeline_config(loans_config(project, "defaulted", secrets={"create_demo_secrets": False}))
    with pytest.raises(DeidKeyError, match="SECURETRAIN_MASK_KEY") as info:
        run_pipeline(config)
    assert "SECURETRAIN_DEID_KEY" in str(info.value)
    assert not (config.run_dir / "data").exists()
    key = os.urandom(32).hex()
    key_file = production_env / "mask.key"  # as Compose / Kubernetes mount it: SECURETRAIN_MASK_KEY_FILE
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    monkeypatch.setenv("SECURETRAIN_MASK_KEY_FILE", str(key_file))
    result = run_pipeline(config)
    assert result.training.class_names == ["no", "yes"]
    for path in config.run_dir.rglob("*"):  # the masking key is never written
        if path.is_file():
            assert key.encode() not in path.read_bytes() and bytes.fromhex(key) not in path.read_bytes()


# ------------------------------------------------------------------ a labels file as teams save it
def test_manifest_saved_by_a_spreadsheet_reads_as_written(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts with a byte-order mark and ends lines with CRLF; people type
    "path, diagnosis". All three read as path,diagnosis (the BOM was refused as a missing 'path')."""
    from securetrain.pipeline.tasks.dicom import read_labelled_manifest

    manifest = tmp_path / "labels.csv"
    manifest.write_bytes("path, diagnosis \r\na/1.dcm,Normal\r\n/abs/2.dcm, pneumonia \r\n".encode("utf-8-sig"))
    assert read_labelled_manifest(manifest, "diagnosis") == [
        (tmp_path / "a" / "1.dcm", "Normal"), (Path("/abs/2.dcm"), "pneumonia")]


def test_manifest_errors_say_what_is_wrong(tmp_path: Path) -> None:
    from securetrain.pipeline.errors import TaskError
    from securetrain.pipeline.tasks.dicom import read_labelled_manifest

    manifest = tmp_path / "labels.csv"
    manifest.write_bytes("path,diagnosis\na.dcm,tumeur maligne \xe9\n".encode("latin-1"))
    with pytest.raises(TaskError, match="not UTF-8") as info:
        read_labelled_manifest(manifest, "diagnosis")
    assert "iconv" in str(info.value)
    manifest.write_text("file,diagnosis\na.dcm,x\n")
    with pytest.raises(TaskError, match=r"needs columns 'path' and 'label' \(its header has 'file', 'diagnosis'\)"):
        read_labelled_manifest(manifest)


def test_a_misspelt_label_or_entity_column_is_named_as_missing(tmp_path: Path) -> None:
    from securetrain.pipeline.errors import TaskError

    project = write_loans_project(tmp_path / "project")
    config = load_pipeline_config(loans_config(project, "Risk"))
    with pytest.raises(TaskError, match=r"data.label_column 'Risk' is not a column of table loans.csv") as info:
        run_pipeline(config)
    assert "did you mean 'risk'" in str(info.value)
    config = load_pipeline_config(loans_config(project, "risk", data={"split_by": "client"}))
    with pytest.raises(TaskError, match=r"data.split_by 'client' is not a column") as info:
        run_pipeline(config)
    assert "'customer_id'" in str(info.value)


# ------------------------------------------------------------------ an undefined validation metric
def test_an_undefined_validation_metric_is_reported_not_silent() -> None:
    """A held-out split of one class (few patients) leaves AUC undefined at every epoch: no best
    checkpoint. The run says so (warning and a report notice) instead of showing 'AUC -' only."""
    from securetrain.pipeline.report import undefined_metric_notice, undefined_metric_text
    from securetrain.pipeline.results import TrainingSummary

    one_class = [{"epoch": 1, "step": 4, "loss": 0.7, "auc": None, "class_counts": [0, 4]},
                 {"epoch": 2, "step": 8, "loss": 0.6, "auc": None, "class_counts": [0, 4]}]
    text = undefined_metric_text("auc", one_class, None)
    assert text is not None and "AUC needs two classes" in text and "[0, 4]" in text
    assert "data.eval_fraction" in text and "no best checkpoint" in text
    summary = TrainingSummary(device="cpu", steps=8, epochs_completed=2, final_loss=0.6, samples_per_second=1.0,
                              validation=one_class, validation_metric="auc")
    assert "No best checkpoint" in undefined_metric_notice(summary)
    # Nothing to say: a defined metric at some epoch, a best entry, or no validation at all.
    assert undefined_metric_text("auc", [*one_class, {"auc": 0.5}], None) is None
    assert undefined_metric_text("auc", one_class, {"metric": "auc"}) is None
    assert undefined_metric_text("auc", [], None) is None
    assert undefined_metric_notice(summary.model_copy(update={"validation_metric": None})) == ""


def test_dicom_run_with_a_one_class_held_out_split_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import csv
    import logging

    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "raw", n_patients=2, studies_per_patient=1, images_per_series=3,
                                  image_size=16, seed=1, include_burned_in=False)
    rows = list(csv.DictReader(manifest.open()))
    with open(manifest, "w", newline="") as handle:  # patient 0 one class, patient 1 the other
        out = csv.DictWriter(handle, fieldnames=list(rows[0]))
        out.writeheader()
        for row in rows:
            row["label"] = "a" if "p000" in row["path"] else "b"
            out.writerow(row)
    data = small_config_data(tmp_path, name="oneclass", data={"source": str(manifest), "eval_fraction": 0.4},
                             training={"epochs": 1, "validation": {"metric": "auc"}},
                             he={"enabled": False}, release={"provenance": False})
    with caplog.at_level(logging.WARNING, logger="securetrain.pipeline"):
        result = run_pipeline(load_pipeline_config(data=data))
    assert result.training.best is None and result.training.validation_metric == "auc"
    assert any("was undefined at every validation" in r.getMessage() for r in caplog.records)
    assert "No best checkpoint" in Path(result.report_html).read_text()


def test_missing_key_errors_survive_log_redaction(tmp_path: Path, production_env: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect logs pass through the redaction filter: 'secret: set X' read '[REDACTED] X' there."""
    from securetrain.masking.dicom.errors import DeidKeyError
    from securetrain.pipeline.secrets import check_provenance_key, load_run_secrets
    from securetrain.redaction import redact

    monkeypatch.delenv("SECURETRAIN_DEID_KEY")
    monkeypatch.delenv("SECURETRAIN_MASK_KEY", raising=False)
    project = write_loans_project(tmp_path / "project")
    for config in (load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False})),
                   load_pipeline_config(loans_config(project, "risk", secrets={"create_demo_secrets": False}))):
        with pytest.raises(DeidKeyError) as info:
            load_run_secrets(config)
        assert redact(str(info.value)) == str(info.value)
        assert "secrets.create_demo_secrets" in str(info.value)
    monkeypatch.setenv("SECURETRAIN_DEID_KEY", os.urandom(32).hex())
    config = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False}))
    load_run_secrets(config)  # a reader of the run's secrets (a release export) needs no signing key
    with pytest.raises(SigningKeyError) as signing:
        check_provenance_key(config)  # a run does, before any work
    assert redact(str(signing.value)) == str(signing.value)


def test_relative_paths_of_files_the_run_reads_resolve_from_the_config_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`securetrain run /etc/team/run.yaml` from anywhere: keys/audit.pem next to the config is found."""
    from securetrain.audit.keys import load_or_create_signing_key

    project = write_loans_project(tmp_path / "project")
    (project / "keys").mkdir(mode=0o700)
    load_or_create_signing_key(project / "keys" / "audit.pem")
    (project / "release.yaml").write_text("{}\n")
    path = loans_config(project, "risk", audit={"signing_key": "keys/audit.pem", "anchor_file": "missing.notes"},
                        secrets={"dir": "keys"}, release={"policy": "release.yaml"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_pipeline_config(path)
    assert config.audit.signing_key == project / "keys" / "audit.pem"
    assert config.secrets.dir == project / "keys" and config.release.policy == project / "release.yaml"
    assert config.audit.anchor_file == Path("missing.notes")  # not there: as written (the working directory)
    (elsewhere / "keys").mkdir()
    (elsewhere / "keys" / "audit.pem").write_text("")
    assert load_pipeline_config(path).audit.signing_key == Path("keys/audit.pem")  # the working directory first

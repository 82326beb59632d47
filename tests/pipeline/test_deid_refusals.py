"""Refused input files in the pipeline: the same rule as `securetrain deid`.

Files the policy rejects (burned-in text, no patient identity) are listed in deid/refused.json,
audited and logged, and the run goes on. Quarantined files (could not be processed) fail the run
before training with RefusedFilesError (exit 65, naming the report) unless data.allow_quarantine
accepts them; the default is false everywhere (the built-in synthetic set plants only rejections)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.masking.dicom.errors import REFUSED_FILES_EXIT_CODE, RefusedFilesError
from securetrain.pipeline import stages
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.secrets import load_run_secrets

from .pipeline_fixtures import ROOT, small_config_data



@pytest.fixture(autouse=True)
def _restore_environment():  # noqa: ANN202
    """A demo flow run exports its generated keyring passphrase into this process (for Prefect's task
    processes); left behind, a later flow run in the same test session took it as the operator's and
    wrote no passphrase file (test_pipeline_flow failed in CI reading it)."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)

def _own_data(tmp_path: Path, *, unreadable: bool = True) -> Path:
    """A site's manifest: synthetic studies with burned-in images (rejected by the policy), plus
    (``unreadable``) a file that is not DICOM (quarantined)."""
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "site", n_patients=3, studies_per_patient=1, images_per_series=2,
                                  image_size=16, include_burned_in=True)
    if unreadable:
        (manifest.parent / "scan-notes.dcm").write_text("not DICOM")
        with manifest.open("a", newline="") as fh:
            csv.writer(fh, lineterminator="\n").writerow(["scan-notes.dcm", "1"])
    return manifest


def _config(tmp_path: Path, source: Path | None, **data: object):
    cfg = small_config_data(tmp_path, name="refusals", secrets={"dir": str(tmp_path / "keys")},
                            he={"enabled": False})
    if source is not None:
        cfg["data"]["source"] = str(source)
        cfg["data"].pop("synthetic")
    cfg["data"].update(data)
    return load_pipeline_config(data=cfg)


def _deidentify(config):  # noqa: ANN001, ANN202
    audit = MemoryAuditRecorder()
    summary = stages.deidentify(config, stages.ingest(config), load_run_secrets(config), audit)
    return summary, audit.events


def test_quarantined_files_fail_the_stage_with_a_report_unless_accepted(tmp_path: Path) -> None:
    """Before 77e060e: the pipeline trained on whatever survived, and the run (and its scheduler) saw success."""
    config = _config(tmp_path, _own_data(tmp_path))
    with pytest.raises(RefusedFilesError) as err:
        _deidentify(config)
    report_path = config.run_dir / "deid" / "refused.json"
    assert err.value.exit_code == REFUSED_FILES_EXIT_CODE == 65 and err.value.report == str(report_path)
    assert "7 of 13 input files not written (6 rejected, 1 quarantined)" in str(err.value)  # both counts
    assert "data.allow_quarantine" in str(err.value)
    report = json.loads(report_path.read_text())
    assert (report["files"], report["rejected"], report["quarantined"], report["accepted"]) == (13, 6, 1, False)
    [quarantined] = [r for r in report["refused"] if r["outcome"] == "quarantined"]
    assert (quarantined["row"], quarantined["reason"]) == (13, "UnreadableDicomError")
    assert quarantined["detail"].startswith("not a DICOM file")
    assert "scan-notes" not in report_path.read_text()  # rows, never paths
    assert not (config.run_dir / "deid" / "train.csv").exists()  # no split: nothing to train on
    # accepted: the same refusals, recorded, and the run goes on
    accepted = _config(tmp_path, config.data.source, allow_quarantine=True)
    summary, events = _deidentify(accepted)
    assert (summary.rejected, summary.quarantined, summary.files_out) == (6, 1, 6)
    assert summary.partial_accepted and summary.refusal_report == report_path
    assert "quarantined files accepted by data.allow_quarantine" in summary.refusal_note()
    assert json.loads(report_path.read_text())["accepted"] is True
    [incomplete] = [e for e in events if e["action"] == "deid.incomplete"]
    assert incomplete["details"] == {"files": 13, "rejected": 6, "quarantined": 1, "accepted": True}


def test_rejected_files_alone_are_reported_and_the_run_goes_on(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Before: burned-in files the policy rejects on purpose failed every run (exit 65)."""
    config = _config(tmp_path, _own_data(tmp_path, unreadable=False))
    assert config.data.allow_quarantine is False
    with caplog.at_level("WARNING", logger="securetrain.pipeline"):
        summary, events = _deidentify(config)
    report_path = config.run_dir / "deid" / "refused.json"
    assert (summary.files_in, summary.rejected, summary.quarantined, summary.files_out) == (12, 6, 0, 6)
    assert summary.refusal_report == report_path and not summary.partial_accepted
    assert (config.run_dir / "deid" / "train.csv").is_file()  # split written: training goes on
    # never silent: the report, the audit log, a warning, the summaries
    report = json.loads(report_path.read_text())
    assert (report["files"], report["rejected"], report["quarantined"], report["accepted"]) == (12, 6, 0, True)
    assert {r["outcome"] for r in report["refused"]} == {"rejected"}
    [incomplete] = [e for e in events if e["action"] == "deid.incomplete"]
    assert incomplete["outcome"] == "success"
    assert incomplete["details"] == {"files": 12, "rejected": 6, "quarantined": 0, "accepted": True}
    [warning] = [r for r in caplog.records if r.levelname == "WARNING" and "refused.json" in r.getMessage()]
    assert "6 of 12 input files not written (6 rejected, 0 quarantined)" in warning.getMessage()
    assert summary.refusal_note() == f"6 files not written (rejected by the policy); refusal report: {report_path}"


def test_synthetic_set_has_no_special_default(tmp_path: Path) -> None:
    """data.allow_quarantine is false for the synthetic set too: it plants rejections only."""
    config = _config(tmp_path, None)
    assert config.data.allow_quarantine is False
    summary, _ = _deidentify(config)
    assert summary.rejected > 0 and summary.quarantined == 0
    assert not summary.partial_accepted and summary.refusal_report is not None


def test_a_clean_run_has_no_report(tmp_path: Path) -> None:
    config = _config(tmp_path, None, synthetic={"n_patients": 2, "studies_per_patient": 1, "images_per_series": 2,
                                                "image_size": 16, "include_burned_in": False})
    stale = config.run_dir / "deid" / "refused.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    summary, events = _deidentify(config)
    assert summary.rejected == summary.quarantined == 0 and summary.refusal_report is None
    assert not summary.partial_accepted and not stale.exists()
    assert not [e for e in events if e["action"] == "deid.incomplete"]


def test_prepare_task_is_not_retried_on_refused_files() -> None:
    sys.path.insert(0, str(ROOT))
    from flows.secure_training import _not_refused

    class State:
        def __init__(self, exc: Exception | None) -> None:
            self.exc = exc

        def result(self) -> None:
            if self.exc:
                raise self.exc

    assert _not_refused(None, None, State(RefusedFilesError("refused"))) is False
    assert _not_refused(None, None, State(OSError("disk hiccup"))) is True
    assert _not_refused(None, None, State(None)) is False


def _run_cli(tmp_path: Path, name: str, *, unreadable: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    import yaml

    cfg = small_config_data(tmp_path / name, name=name, secrets={"dir": str(tmp_path / name / "keys")},
                            he={"enabled": False})
    cfg["data"]["source"] = str(_own_data(tmp_path / name, unreadable=unreadable))
    cfg["data"].pop("synthetic")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURETRAIN_", "PREFECT_API"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "ph"), COLUMNS="400")
    proc = subprocess.run([sys.executable, "-m", "securetrain", "run", str(path), "--no-prefect"], env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, tmp_path / name / "runs" / name


@pytest.mark.slow
def test_securetrain_run_exits_65_only_with_quarantined_files(tmp_path: Path) -> None:
    proc, run_dir = _run_cli(tmp_path, "site", unreadable=True)
    assert proc.returncode == 65, proc.stderr[-3000:]
    assert f"Report: {run_dir / 'deid' / 'refused.json'}" in proc.stderr.replace("\n", "")
    assert "Traceback" not in proc.stderr
    assert not list(run_dir.glob("checkpoints/*.stenc"))
    # the policy's rejections alone: the run trains, and says what it rejected and where it is listed
    proc, run_dir = _run_cli(tmp_path, "rejected", unreadable=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(run_dir.glob("checkpoints/*.stenc"))
    report = run_dir / "deid" / "refused.json"
    assert "6 of 12 input files not written (6 rejected, 0 quarantined)" in proc.stderr.replace("\n", "")  # warning
    assert f"refusal report: {report}" in proc.stdout.replace("\n", "")  # the summary table
    result = json.loads((run_dir / "result.json").read_text())
    assert result["deid"]["rejected"] == 6 and result["deid"]["refusal_report"] == str(report)
    assert result["deid"]["partial_accepted"] is False


@pytest.mark.slow
def test_the_prefect_flow_run_fails_with_the_same_error_and_no_retry(tmp_path: Path) -> None:
    """Under Prefect (a deployment or `serve` schedule): the flow run ends Failed, not Completed."""
    pytest.importorskip("prefect")
    import yaml
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(ROOT))
    from flows.secure_training import secure_training

    cfg = small_config_data(tmp_path, name="site", secrets={"dir": str(tmp_path / "keys")}, he={"enabled": False})
    cfg["data"]["source"] = str(_own_data(tmp_path))
    cfg["data"].pop("synthetic")
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "storage"}), \
            prefect_test_harness(server_startup_timeout=240):
        with pytest.raises(RefusedFilesError) as err:
            secure_training(config_path=str(path))
        with get_client(sync_client=True) as client:
            prepare = [r for r in client.read_task_runs() if r.name.startswith("prepare-data")]
            flows = client.read_flow_runs()
    assert err.value.exit_code == 65
    assert [(r.state_name, r.run_count) for r in prepare] == [("Failed", 1)]  # not retried
    assert [r.state_name for r in flows] == ["Failed"]


def test_the_report_says_why_each_file_was_quarantined_without_its_path(tmp_path: Path) -> None:
    """refused.json gave only the error type ("UnreadableDicomError") for every quarantined file, so
    a truncated file, a non-DICOM one and a data set contradicting its file meta looked alike; the
    `detail` is the reason `securetrain deid` prints, naming the row, never the input path."""
    manifest = _own_data(tmp_path)
    import pydicom

    cut = manifest.parent / "cut-PATIENTNAME.dcm"
    first = next(p for p in sorted(manifest.parent.rglob("*.dcm")) if pydicom.dcmread(p, force=True).get("Modality") == "CT")
    cut.write_bytes(first.read_bytes()[:-40])
    with manifest.open("a", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerow([cut.name, "0"])
    config = _config(tmp_path, manifest, allow_quarantine=True)
    _deidentify(config)
    text = (config.run_dir / "deid" / "refused.json").read_text()
    refused = {r["row"]: r for r in json.loads(text)["refused"]}
    assert refused[13] == {"row": 13, "outcome": "quarantined", "reason": "UnreadableDicomError",
                           "detail": "not a DICOM file (no DICM preamble/prefix, and the content is not a data "
                                     "set with a SOP Class UID and SOP Instance UID)"}
    assert refused[14]["reason"] == "UnreadableDicomError"
    assert refused[14]["detail"].endswith("bytes (truncated file?)") and "row" not in refused[14]["detail"]
    assert "PATIENTNAME" not in text and "scan-notes" not in text
    rejected = [r for r in refused.values() if r["outcome"] == "rejected"]
    assert rejected and all("detail" not in r for r in rejected)  # the reason category says it all

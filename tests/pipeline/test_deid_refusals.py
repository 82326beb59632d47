"""Refused input files (rejected or quarantined) in the pipeline: the same rule as `securetrain deid`.

A run whose de-identification refused files fails before training with RefusedFilesError (exit 65,
naming deid/refused.json) unless data.allow_quarantine accepts partial output; the built-in
synthetic set, whose burned-in files are planted to be rejected, accepts it by default."""

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


def _own_data(tmp_path: Path) -> Path:
    """A site's manifest: synthetic studies with burned-in images, plus a file that is not DICOM."""
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "site", n_patients=3, studies_per_patient=1, images_per_series=2,
                                  image_size=16, include_burned_in=True)
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


def test_refused_files_fail_the_stage_with_a_report_unless_accepted(tmp_path: Path) -> None:
    """Before: the pipeline trained on whatever survived, and the run (and its scheduler) saw success."""
    config = _config(tmp_path, _own_data(tmp_path))
    with pytest.raises(RefusedFilesError) as err:
        _deidentify(config)
    report_path = config.run_dir / "deid" / "refused.json"
    assert err.value.exit_code == REFUSED_FILES_EXIT_CODE == 65 and err.value.report == str(report_path)
    assert "refused 7 of 13 input files (6 rejected, 1 quarantined)" in str(err.value)
    assert "data.allow_quarantine" in str(err.value)
    report = json.loads(report_path.read_text())
    assert (report["files"], report["rejected"], report["quarantined"], report["accepted"]) == (13, 6, 1, False)
    assert {"row": 13, "outcome": "quarantined", "reason": "UnreadableDicomError"} in report["refused"]
    assert "scan-notes" not in report_path.read_text()  # rows, never paths
    assert not (config.run_dir / "deid" / "train.csv").exists()  # no split: nothing to train on
    # accepted: the same refusals, recorded, and the run goes on
    accepted = _config(tmp_path, config.data.source, allow_quarantine=True)
    summary, events = _deidentify(accepted)
    assert (summary.rejected, summary.quarantined, summary.files_out) == (6, 1, 6)
    assert summary.partial_accepted and summary.refusal_report == report_path
    assert json.loads(report_path.read_text())["accepted"] is True
    [incomplete] = [e for e in events if e["action"] == "deid.incomplete"]
    assert incomplete["details"] == {"files": 13, "rejected": 6, "quarantined": 1, "accepted": True}


def test_synthetic_set_accepts_its_planted_refusals_by_default(tmp_path: Path) -> None:
    summary, _ = _deidentify(_config(tmp_path, None))
    assert summary.rejected > 0 and summary.partial_accepted and summary.refusal_report is not None
    with pytest.raises(RefusedFilesError):
        _deidentify(_config(tmp_path, None, allow_quarantine=False))


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


@pytest.mark.slow
def test_securetrain_run_exits_65_naming_the_report(tmp_path: Path) -> None:
    import yaml

    cfg = small_config_data(tmp_path, name="site", secrets={"dir": str(tmp_path / "keys")}, he={"enabled": False})
    cfg["data"]["source"] = str(_own_data(tmp_path))
    cfg["data"].pop("synthetic")
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURETRAIN_", "PREFECT_API"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "ph"), COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "securetrain", "run", str(path), "--no-prefect"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 65, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "site"
    assert f"Report: {run_dir / 'deid' / 'refused.json'}" in proc.stderr.replace("\n", "")
    assert "Traceback" not in proc.stderr
    assert not list(run_dir.glob("checkpoints/*.stenc"))


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

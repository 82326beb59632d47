"""The secure_training flow end to end under Prefect's test harness, then the auditor's verifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .pipeline_fixtures import ROOT, planted_phi, small_config_data

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory: pytest.TempPathFactory):
    import yaml
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(ROOT))
    from flows.secure_training import secure_training

    tmp = tmp_path_factory.mktemp("flow")
    # Demo secrets only: an earlier test of the session may have left a passphrase in the environment.
    saved = os.environ.copy()
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_KEK", "SECURETRAIN_DEID_KEY"):
        os.environ.pop(var, None)
    config_file = tmp / "run.yaml"
    config_file.write_text(yaml.safe_dump(small_config_data(tmp, name="flow")))
    storage = tmp / "prefect-storage"
    # The ephemeral server needs 15-25 s on these machines; be generous.
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage}), prefect_test_harness(server_startup_timeout=240):
        result = secure_training(config_path=str(config_file))
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            logs = [log.message for log in client.read_logs()]
            artifacts = {a.key: a for a in client.read_artifacts() if a.key}
    os.environ.clear()
    os.environ.update(saved)
    return tmp / "runs" / "flow", result, storage, logs, artifacts


def test_flow_completes_every_stage(flow_run) -> None:
    run_dir, result, _, _, _ = flow_run
    assert result["deid"]["files_out"] > 0 and result["training"]["steps"] > 0
    assert result["he"]["max_abs_error"] < 1e-3
    assert result["audit"]["verified"] is True
    assert Path(result["report_html"]).is_file() and Path(result["curve_png"]).is_file()


def test_report_names_the_flow_run_and_times_every_stage(flow_run) -> None:
    _, result, _, _, _ = flow_run
    run = result["run"]
    assert run["flow_run_id"] and run["started_at"] <= run["finished_at"]
    assert list(run["stage_seconds"]) == ["ingest", "prepare-data", "train", "extract-features", "he-evaluate",
                                          "sign-provenance", "seal-audit"]
    page = Path(result["report_html"]).read_text()
    assert run["flow_run_id"] in page and "stage timings" in page


def test_standalone_verifier_accepts_the_sealed_log(flow_run) -> None:
    run_dir, result, _, _, _ = flow_run
    export = Path(result["audit"]["export_dir"])
    proc = subprocess.run(
        [sys.executable, "-I", str(ROOT / "audit" / "verify_audit.py"), str(export),
         "--public-key", str(run_dir / "audit-public-key.pem"),
         "--trusted-checkpoint", str(run_dir / "audit-checkpoint.note")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_results_are_json_or_encrypted_never_pickle(flow_run) -> None:
    _, _, storage, _, _ = flow_run
    kinds = []
    for record_file in storage.iterdir():
        record = json.loads(record_file.read_text())
        if "metadata" not in record:  # the flow's own JSON result
            continue
        kinds.append(record["metadata"]["serializer"]["type"])
    assert "securetrain-encrypted" in kinds  # the HE features (tensors)
    assert set(kinds) <= {"json", "securetrain-encrypted"}


def test_no_phi_or_key_material_reaches_prefect(flow_run) -> None:
    run_dir, result, storage, logs, artifacts = flow_run
    secrets = [(run_dir / "keys" / name).read_text().strip() for name in ("deid.key", "keyring.passphrase")]
    haystack = "\n".join([json.dumps(result), *logs, *(str(a.data) for a in artifacts.values())])
    haystack += "\n".join(p.read_text(errors="replace") for p in storage.iterdir())
    upper = haystack.upper()
    leaks = [v for v in planted_phi(run_dir) if v.upper() in upper]
    assert not leaks, f"PHI reached Prefect: {leaks[:3]}"
    for secret in secrets:
        assert secret not in haystack


def test_run_artifacts_are_published(flow_run) -> None:
    _, result, _, _, artifacts = flow_run
    assert {"securetrain-run", "securetrain-deid", "securetrain-training-curve", "securetrain-checkpoints",
            "securetrain-audit-head"} <= set(artifacts)
    assert result["audit"]["root_hash"] in str(artifacts["securetrain-audit-head"].data)


def test_prefect_yaml_deployment_points_at_the_flow() -> None:
    import yaml
    from cronsim import CronSim  # shipped with prefect

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (deployment,) = spec["deployments"]
    path, _, name = deployment["entrypoint"].partition(":")
    assert (ROOT / path).is_file() and f"def {name}(" in (ROOT / path).read_text()
    for schedule in deployment["schedules"]:
        from datetime import datetime

        next(iter(CronSim(schedule["cron"], datetime(2026, 1, 1))))
    assert (ROOT / deployment["parameters"]["config_path"]).is_file()
    assert not any(k for k in json.dumps(spec).lower().split('"') if "passphrase=" in k or "secret=" in k)


def test_serve_entry_point_schedules_the_flow_with_cron(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT))
    import flows.serve as serve

    calls: dict = {}
    monkeypatch.setattr(serve.secure_training, "serve", lambda **kw: calls.update(kw))
    serve.main(["examples/demo.yaml", "--cron", "30 1 * * *"])
    assert calls["cron"] == "30 1 * * *" and calls["name"] == "secure-training-nightly"
    assert Path(calls["parameters"]["config_path"]).is_absolute()
    assert set(calls["parameters"]) == {"config_path", "new_run"}  # no secrets as deployment parameters
    assert calls["parameters"]["new_run"] is True  # each scheduled run in its own folder

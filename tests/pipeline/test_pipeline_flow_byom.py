"""The secure_training flow under Prefect with a user's model (3-class DICOM) and the finance task."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from .pipeline_fixtures import (
    ROOT,
    byom_config,
    finance_config,
    finance_pii,
    scan_for,
    three_class_dicom,
    write_user_model,
)

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flow_runs(tmp_path_factory: pytest.TempPathFactory):
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(ROOT))
    from flows.secure_training import secure_training

    tmp = tmp_path_factory.mktemp("flow-byom")
    project = tmp / "project"
    write_user_model(project)
    byom_file = project / "byom.yaml"
    byom_file.write_text(yaml.safe_dump(byom_config(tmp, three_class_dicom(tmp / "studies"), name="flowbyom")))
    finance_file = tmp / "finance.yaml"
    finance_file.write_text(yaml.safe_dump(finance_config(tmp, name="flowfin")))
    storage = tmp / "prefect-storage"
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage}), prefect_test_harness(server_startup_timeout=240):
        try:
            byom = secure_training(config_path=str(byom_file))
        finally:
            sys.modules.pop("mynets", None)
        finance = secure_training(config_path=str(finance_file))
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            logs = [log.message for log in client.read_logs()]
            artifacts = {a.key for a in client.read_artifacts() if a.key}
    return tmp, byom, finance, storage, logs, artifacts


def test_user_model_trains_through_the_flow(flow_runs) -> None:
    from securetrain.crypto.checkpoint import EncryptedCheckpointStore
    from securetrain.pipeline.config import load_pipeline_config
    from securetrain.pipeline.secrets import load_run_secrets

    tmp, byom, _, _, _, artifacts = flow_runs
    t = byom["training"]
    assert t["model_target"] == "mynets:build" and t["class_names"] == ["benign", "malignant", "normal"]
    assert len(t["validation"]) == 3 and all(len(v["class_counts"]) == 3 for v in t["validation"])
    run_dir = tmp / "runs" / "flowbyom"
    assert json.loads((run_dir / "result.json").read_text())["training"]["validation"] == t["validation"]
    config = load_pipeline_config(tmp / "project" / "byom.yaml")
    loaded = EncryptedCheckpointStore(run_dir / "checkpoints", load_run_secrets(config).keyring).load()
    assert {"model/encoder.0.weight", "model/classifier.weight"} <= set(loaded.tensors)
    assert byom["he"]["outputs"] == 3 and byom["audit"]["verified"] is True
    assert "securetrain-validation" in artifacts


def test_finance_through_the_flow(flow_runs) -> None:
    tmp, _, finance, _, _, artifacts = flow_runs
    assert finance["masking"]["train_entities"] > 0 and finance["he"]["scope"] == "model"
    assert finance["audit"]["verified"] is True and "securetrain-masking" in artifacts
    assert scan_for(tmp / "runs" / "flowfin", finance_pii(tmp / "runs" / "flowfin" / "raw" / "transactions.parquet")) > 10


def test_no_phi_pii_or_pickle_reaches_prefect(flow_runs) -> None:
    tmp, byom, finance, storage, logs, _ = flow_runs
    phi = json.loads((tmp / "studies" / "phi.json").read_text())
    values = {v for kind in ("text", "dates", "uids") for v in phi["all"].get(kind, []) if len(v) >= 6}
    values |= {v.decode() for v in finance_pii(tmp / "runs" / "flowfin" / "raw" / "transactions.parquet")}
    haystack = "\n".join([json.dumps(byom), json.dumps(finance), *logs])
    kinds = []
    for record_file in storage.iterdir():
        text = record_file.read_text(errors="replace")
        haystack += text
        record = json.loads(text)
        if "metadata" in record:
            kinds.append(record["metadata"]["serializer"]["type"])
    assert set(kinds) <= {"json", "securetrain-encrypted"} and "securetrain-encrypted" in kinds
    upper = haystack.upper()
    leaks = [v for v in values if v.upper() in upper]
    assert not leaks, f"PHI/PII reached Prefect: {leaks[:3]}"

"""The production shape end to end: PostgreSQL audit log, DataLoader workers, with and without Prefect.

A run with ``audit.url`` on PostgreSQL and ``training.num_workers: 2`` once hung ~10 minutes and then
failed with connections shared across forked workers (issue 10)."""

from __future__ import annotations

import os
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import open_run_audit, run_pipeline

from .pipeline_fixtures import ROOT, small_config_data

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")
pytestmark = [pytest.mark.slow, pytest.mark.postgres]

POSTGRES_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def pg_schema() -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(LIBPQ, connect_timeout=3).close()
    except Exception:  # noqa: BLE001
        pytest.skip("PostgreSQL not reachable")
    schema = f"st_pipe_{uuid.uuid4().hex[:10]}"
    yield schema
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _config(tmp_path: Path, schema: str, name: str):
    data = small_config_data(tmp_path, name=name, audit={"url": POSTGRES_URL, "schema": schema},
                             training={"num_workers": 2, "epochs": 2})
    return load_pipeline_config(data=data)


def _assert_audited_run(config, result) -> None:  # noqa: ANN001
    assert result.training.steps > 0
    assert result.audit is not None and result.audit.verified, result.audit.verifier_output
    with open_run_audit(config) as log:
        assert log.schema == config.audit.schema_name  # the run's own schema, not the default one
        actions = Counter(e.action for e in log.entries())
        seqs = [e.seq for e in log.entries()]
        assert log.verify().ok
    assert seqs == list(range(len(seqs)))  # dense: no gaps, no forks from the worker processes
    # every training sample read in a worker is on the log: 2 epochs over the de-identified training files
    assert actions["dicom.read"] >= 2 * result.deid.files_out * 0.5
    assert {"training.start", "training.stop", "checkpoint.write", "pipeline.stop"} <= set(actions)
    assert not (config.run_dir / "audit.db").exists()  # nothing fell back to SQLite


def test_pipeline_on_postgres_with_dataloader_workers(tmp_path: Path, pg_schema: str) -> None:
    config = _config(tmp_path, pg_schema, "pgworkers")
    _assert_audited_run(config, run_pipeline(config))


def test_flow_on_postgres_with_dataloader_workers(tmp_path: Path, pg_schema: str) -> None:
    import yaml
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(ROOT))
    from flows.secure_training import secure_training

    config = _config(tmp_path, pg_schema, "pgflow")
    config_file = tmp_path / "run.yaml"
    data = small_config_data(tmp_path, name="pgflow", audit={"url": POSTGRES_URL, "schema": pg_schema},
                             training={"num_workers": 2, "epochs": 2})
    config_file.write_text(yaml.safe_dump(data))
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "storage"}), \
            prefect_test_harness(server_startup_timeout=240):
        result = secure_training(config_path=str(config_file))
    assert result["training"]["steps"] > 0 and result["audit"]["verified"] is True
    from securetrain.pipeline.results import PipelineResult

    _assert_audited_run(config, PipelineResult.model_validate(result))

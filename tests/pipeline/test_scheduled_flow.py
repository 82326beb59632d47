"""Two scheduled invocations of the secure_training *flow* (new_run=True, as serve.py and prefect.yaml
pass it), under Prefect's test harness: two run folders named by time and flow run id, the second
trains >0 steps and reports the inputs that arrived in between (by digest) (issue 17)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from securetrain.masking.dicom.synthetic import generate_study_set

from .pipeline_fixtures import ROOT, add_studies, small_config_data

pytestmark = pytest.mark.slow


def test_two_scheduled_flow_runs(tmp_path: Path) -> None:
    import yaml
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(ROOT))
    from flows.secure_training import secure_training

    manifest = generate_study_set(tmp_path / "studies", n_patients=4, studies_per_patient=1, images_per_series=3,
                                  image_size=16, seed=0)
    data = small_config_data(tmp_path, name="nightly", secrets={"dir": str(tmp_path / "keys")}, training={"epochs": 1})
    data["data"]["source"] = str(manifest)
    data["data"].pop("synthetic")
    data["he"] = {"enabled": False}
    data["release"] = {"provenance": False}
    config_file = tmp_path / "nightly.yaml"
    config_file.write_text(yaml.safe_dump(data))

    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "prefect-storage"}), \
            prefect_test_harness(server_startup_timeout=240):
        first = secure_training(config_path=str(config_file), new_run=True)
        added = add_studies(manifest, tmp_path / "more")
        second = secure_training(config_path=str(config_file), new_run=True)

    dirs = [Path(first["run_dir"]), Path(second["run_dir"])]
    assert dirs[0] != dirs[1] and all(d.parent == tmp_path / "runs" and d.is_dir() for d in dirs)
    for result, folder in zip((first, second), dirs, strict=True):
        flow_run_id = result["run"]["flow_run_id"]
        assert flow_run_id and folder.name.startswith("nightly-")
        assert folder.name.endswith("-" + flow_run_id.replace("-", "")[:8])  # time stamp + flow run id
        assert result["training"]["steps"] > 0 and result["training"]["resumed_from"] is None
    changes = second["run"]["input_changes"]
    assert changes["previous_run"] == dirs[0].name and changes["new"] == len(added) > 0
    assert changes["inputs"] == first["run"]["input_changes"]["inputs"] + len(added)
    page = Path(second["report_html"]).read_text()
    assert changes["new_sha256"][0] in page and "resumed a finished run" not in page

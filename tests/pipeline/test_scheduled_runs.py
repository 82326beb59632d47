"""Scheduled runs: each in its own folder, trained on the data present then, new inputs reported.

Before: every scheduled run after the first resumed the finished run folder and trained 0 steps."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from securetrain.masking.dicom.synthetic import generate_study_set
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline
from securetrain.pipeline.schedule import scheduled_run_config

from .pipeline_fixtures import ROOT, add_studies, small_config_data

pytestmark = pytest.mark.slow


def _nightly(tmp_path: Path, manifest: Path):  # noqa: ANN202
    data = small_config_data(tmp_path, name="nightly", secrets={"dir": str(tmp_path / "keys")},
                             training={"epochs": 1})
    data["data"]["source"] = str(manifest)
    data["data"].pop("synthetic")
    data["he"] = {"enabled": False}
    data["release"] = {"provenance": False}
    return load_pipeline_config(data=data)


def test_each_scheduled_run_trains_in_its_own_folder_and_reports_new_inputs(tmp_path: Path) -> None:
    manifest = generate_study_set(tmp_path / "studies", n_patients=4, studies_per_patient=1, images_per_series=3,
                                  image_size=16, seed=0)
    config = _nightly(tmp_path, manifest)
    first = run_pipeline(scheduled_run_config(config, now=datetime(2026, 12, 1, 2, 0, tzinfo=UTC)))
    assert first.run_dir.name == "nightly-20261201T020000Z" and first.training.steps > 0
    changes = first.run.input_changes
    assert changes is not None and changes["previous_run"] is None and changes["new"] == changes["inputs"] == 12

    # New studies arrive during the day (a second site); the manifest grows.
    added = add_studies(manifest, tmp_path / "more")

    second = run_pipeline(scheduled_run_config(config, now=datetime(2026, 12, 2, 2, 0, tzinfo=UTC)))
    assert second.run_dir.name == "nightly-20261202T020000Z" and second.run_dir != first.run_dir
    assert second.training.steps > 0  # not a resume of the finished first run
    changes = second.run.input_changes
    assert changes == {"series": "nightly", "previous_run": first.run_dir.name, "inputs": 12 + len(added),
                       "new": len(added), "removed": 0, "new_sha256": changes["new_sha256"]}
    assert len(changes["new_sha256"]) == len(added) and all(len(d) == 64 for d in changes["new_sha256"])
    page = second.report_html.read_text()
    assert "inputs new since the previous run" in page and changes["new_sha256"][0] in page
    assert "studies" not in json.dumps(changes) and "more" not in json.dumps(changes)  # digests, never paths
    assert json.loads((first.run_dir / "result.json").read_text())["training"]["steps"] == first.training.steps


def test_schedules_ask_for_a_new_run_each_time() -> None:
    import yaml

    deployment = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][0]
    assert deployment["parameters"]["new_run"] is True and deployment["concurrency_limit"] == 1
    serve = (ROOT / "flows" / "serve.py").read_text()
    assert '"new_run": True' in serve and "global_limit=1" in serve


def test_run_names_stay_valid_and_distinct() -> None:
    config = load_pipeline_config(data={"name": "a" * 64})
    one = scheduled_run_config(config, now=datetime(2026, 1, 1, tzinfo=UTC), flow_run_id="0f9e-77aa-bb")
    assert one.series == "a" * 64 and len(one.name) <= 64 and one.name.endswith("-20260101T000000Z-0f9e77aa")
    again = scheduled_run_config(one, now=datetime(2026, 1, 2, tzinfo=UTC))
    assert again.series == one.series and again.name != one.name
    load_pipeline_config(data={"name": one.name})  # passes the config's own name pattern


def test_previous_run_is_of_the_same_series_only(tmp_path: Path) -> None:
    from securetrain.pipeline.schedule import INPUTS_FILE, previous_run, write_inputs

    def run_of(series: str, day: int, flow_run_id: str | None = None):  # noqa: ANN202
        base = load_pipeline_config(data={"name": series, "output_dir": str(tmp_path)})
        return scheduled_run_config(base, now=datetime(2026, 12, day, 2, 0, tzinfo=UTC), flow_run_id=flow_run_id)

    nightly_1, eu_2, nightly_3 = run_of("nightly", 1), run_of("nightly-1a", 2), run_of("nightly", 3, "ab12")
    for cfg in (nightly_1, eu_2):
        cfg.run_dir.mkdir(parents=True)
        write_inputs(cfg.run_dir, {"0" * 64})
    # The other series' later run ("nightly-1a-...", which starts with "nightly") is not this series' previous run.
    assert previous_run(nightly_3) == nightly_1.run_dir
    assert previous_run(eu_2) is None and previous_run(nightly_1) is None  # nothing earlier of their own
    (nightly_1.run_dir / INPUTS_FILE).unlink()  # a run that never recorded its inputs does not count
    assert previous_run(nightly_3) is None
    # A long series is cut to fit the stamp: still found, and ordered by time, not by name.
    long_a, long_b = run_of("s" * 64, 4, "ffffffff"), run_of("s" * 64, 5)
    long_a.run_dir.mkdir(parents=True)
    write_inputs(long_a.run_dir, {"1" * 64})
    assert previous_run(long_b) == long_a.run_dir


def test_two_runs_in_the_same_second_get_two_folders(tmp_path: Path) -> None:
    config = load_pipeline_config(data={"name": "byhand", "output_dir": str(tmp_path)})
    now = datetime(2026, 1, 1, tzinfo=UTC)
    first = scheduled_run_config(config, now=now)
    first.run_dir.mkdir(parents=True)
    second = scheduled_run_config(config, now=now)
    assert second.run_dir != first.run_dir and second.name.startswith(first.name + "-")
    load_pipeline_config(data={"name": second.name})

"""The report says why files were refused, and says so when a run only resumed a finished one."""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline

from .pipeline_fixtures import small_config_data

pytestmark = pytest.mark.slow


def test_refusals_by_reason_and_the_resumed_notice(tmp_path: Path) -> None:
    data = small_config_data(tmp_path, name="again", training={"epochs": 1})
    data["he"] = {"enabled": False}
    config = load_pipeline_config(data=data)
    first = run_pipeline(config)
    d = first.deid
    assert d is not None and d.rejected > 0
    assert d.refused_by_reason.get("rejected: burned_in_annotation") == d.rejected
    assert sum(d.refused_by_reason.values()) == d.rejected + d.quarantined
    page = first.report_html.read_text()
    assert "<tr><td>rejected: burned_in_annotation</td>" in page
    assert first.training.resumed_from is None and "resumed a finished run" not in page
    # Which keys were used, by id and fingerprint; no key material anywhere in the report.
    keys = first.keys
    assert {"kek_id", "kek_fingerprint", "deid_key_id", "audit_public_key_sha256"} <= set(keys)
    assert keys["kek_fingerprint"] in page and keys["deid_key_id"] in page and keys["audit_public_key_sha256"] in page
    deid_secret = (config.run_dir / "keys" / "deid.key").read_text().strip()
    assert deid_secret not in page and deid_secret not in (config.run_dir / "result.json").read_text()

    second = run_pipeline(config)  # the same folder: the finished run is resumed, nothing left to train
    assert second.training.resumed_from == second.training.steps == first.training.steps
    page = second.report_html.read_text()
    assert "resumed a finished run" in page and "--new-run" in page

"""The demo repeats: the public demo de-identification key fixes pseudonyms, the patient split and
therefore the metrics (with a random demo key the AUC ranged 0.68-1.00 across runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline
from securetrain.pipeline.secrets import DEMO_DEID_KEY_HEX, DEID_KEY_FILE, keys_dir

from .pipeline_fixtures import small_config_data

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, name: str, key: str):  # noqa: ANN202
    data = small_config_data(tmp_path / name, name=name, secrets={"demo_deid_key": key},
                             training={"epochs": 2})
    data["data"]["synthetic"].update(n_patients=12)  # enough patients for the split to depend on the key
    config = load_pipeline_config(data=data)
    result = run_pipeline(config)
    metrics = [{k: v for k, v in val.items() if k not in ("seconds", "wall_s")} for val in result.training.validation]
    deid_key = (keys_dir(config) / DEID_KEY_FILE).read_text().strip()
    labelled = "DEMO KEY" in result.report_html.read_text() and "demo only" in result.keys["deid_key_note"]
    assert result.he is not None  # the demo's HE metrics are in the report too: they must repeat as well
    he = (result.he.plaintext_auc, result.he.encrypted_auc, result.he.plaintext_accuracy, result.he.encrypted_accuracy)
    return result.training.curve, metrics, deid_key, labelled, he


def test_fixed_demo_key_makes_two_runs_identical(tmp_path: Path) -> None:
    first = _run(tmp_path, "a", "fixed")
    second = _run(tmp_path, "b", "fixed")
    assert first[2] == second[2] == DEMO_DEID_KEY_HEX
    assert first[0] and first[0] == second[0]  # the same loss at every step
    assert first[1] == second[1]  # the same validation metrics
    assert first[4] == second[4]  # HE AUC and accuracy, plaintext and encrypted
    assert first[3] and second[3]  # the report says the public demo key protects nothing


def test_random_demo_key_differs_and_fixed_needs_demo_mode(tmp_path: Path) -> None:
    from securetrain.errors import ConfigError

    a = small_config_data(tmp_path / "r", name="r")
    config = load_pipeline_config(data=a)
    from securetrain.pipeline.secrets import load_run_secrets

    load_run_secrets(config)
    from securetrain.pipeline.runner import key_fingerprints

    assert "deid_key_note" not in key_fingerprints(config)  # a random key is not labelled as the demo key
    assert (keys_dir(config) / DEID_KEY_FILE).read_text().strip() != DEMO_DEID_KEY_HEX
    bad = small_config_data(tmp_path / "p", name="p", secrets={"create_demo_secrets": False, "demo_deid_key": "fixed"})
    with pytest.raises(ConfigError, match="demo_deid_key"):
        load_pipeline_config(data=bad)

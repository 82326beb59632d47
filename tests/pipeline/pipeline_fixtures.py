"""Small pipeline configs for tests (a few seconds of training on CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def small_config_data(tmp_path: Path, name: str = "t", **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "output_dir": str(tmp_path / "runs"),
        "data": {
            "policy": str(ROOT / "policies" / "dicom-basic.yaml"),
            "image_size": 16,
            "synthetic": {"n_patients": 4, "studies_per_patient": 1, "images_per_series": 4, "image_size": 16},
        },
        "model": {"channels": 4, "hidden": 8},
        "training": {"epochs": 2, "batch_size": 4, "checkpoint_every": 2, "log_every": 1, "lr": 0.01},
        "secrets": {"create_demo_secrets": True},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def planted_phi(run_dir: Path) -> set[str]:
    """Every PHI string the synthetic generator planted (dates/UIDs too), length >= 6."""
    phi = json.loads((run_dir / "raw" / "phi.json").read_text())
    values: set[str] = set()
    for kind in ("text", "dates", "uids"):
        values.update(v for v in phi["all"].get(kind, []) if len(v) >= 6)
    return values

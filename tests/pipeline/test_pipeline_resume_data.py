"""A rerun of a DICOM run whose labels changed is refused, not resumed on the old checkpoints.

Resume compared only the dataset's length; relabelled studies (the same files) resumed the weights
trained on the old labels, and the run's record named only the new manifest.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline
from securetrain.training.errors import ResumeMismatchError

from .pipeline_fixtures import small_config_data


@pytest.mark.slow
def test_relabelled_studies_are_refused_on_resume(tmp_path: Path) -> None:
    data = small_config_data(tmp_path, training={"epochs": 1}, he={"enabled": False})
    first = run_pipeline(load_pipeline_config(data=data))
    again = run_pipeline(load_pipeline_config(data=data))  # the same data: resumes (nothing left to train)
    assert again.training.resumed_from == first.training.steps
    manifest = first.run_dir / "raw" / "manifest.csv"
    rows = list(csv.DictReader(manifest.open()))
    labels = sorted({r["label"] for r in rows})
    own = tmp_path / "manifest.csv"
    with own.open("w", newline="") as f:  # the same files, every label swapped for another class
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            path = Path(r["path"])
            writer.writerow({**r, "path": str(path if path.is_absolute() else manifest.parent / path),
                             "label": labels[(labels.index(r["label"]) + 1) % len(labels)]})
    data["data"]["source"] = str(own)
    with pytest.raises(ResumeMismatchError, match="the training data differ from the data its checkpoints"):
        run_pipeline(load_pipeline_config(data=data))

"""The HTML report answers an auditor's first questions: which code, when, how long, which keys,
what the numbers mean (issue 17)."""

from __future__ import annotations

import re
from pathlib import Path

from securetrain.pipeline.report import markdown_summary, smoothed_loss, write_html_report
from securetrain.pipeline.results import (
    CheckpointSummary,
    HESummary,
    PipelineResult,
    TrainingSummary,
)
from securetrain.pipeline.runinfo import StageClock


def _result(tmp_path: Path) -> PipelineResult:
    curve = [(i, 1.0 / (i + 1) + (0.9 if i == 99 else 0.0)) for i in range(100)]  # a noisy last batch
    training = TrainingSummary(device="cpu", steps=100, epochs_completed=2, final_loss=curve[-1][1],
                               samples_per_second=10.0, curve=curve,
                               checkpoints=[CheckpointSummary(path=tmp_path / "step-000000000100.stenc", step=100,
                                                              sha256="ab" * 32, key_id="kek-2026")])
    he = HESummary(samples=10, features=4, max_abs_error=1e-4, plaintext_auc=0.9, encrypted_auc=0.9,
                   plaintext_accuracy=0.8, encrypted_accuracy=0.7, ms_per_sample=1.0, poly_modulus_degree=8192,
                   public_context_bytes=1000)
    return PipelineResult(run_dir=tmp_path, training=training, he=he, config_sha256="cd" * 32)


def test_report_shows_provenance_timings_keys_and_explains_he(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SECURETRAIN_SOURCE_COMMIT", "0123456789abcdef")
    clock = StageClock()
    with clock.stage("ingest"):
        pass
    with clock.stage("train"):
        pass
    result = _result(tmp_path)
    result.run = clock.info()
    page = write_html_report(result, tmp_path / "report.html").read_text()
    assert "0123456789abcdef" in page and result.run.securetrain_version in page
    assert "--no-prefect" in page  # no flow run outside Prefect, and it says so
    assert re.search(r"ingest \d+\.\d s, train \d+\.\d s", page)
    assert result.run.started_at and result.run.started_at in page and result.run.finished_at in page
    assert "kek-2026" in page and "cd" * 32 in page
    assert "threshold" in page and "AUC" in page  # HE metrics explained
    smooth = smoothed_loss(result.training)
    assert smooth is not None and smooth < 0.5 < result.training.final_loss  # not the noisy last batch
    assert f"{smooth:.4f}" in page and "last logged batch" in page
    assert "smoothed loss" in markdown_summary(result)


def test_report_without_run_info_still_renders(tmp_path: Path) -> None:
    page = write_html_report(_result(tmp_path), tmp_path / "r.html").read_text()
    assert "<h2>Run</h2>" in page and "securetrain version" in page

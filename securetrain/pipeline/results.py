"""What each pipeline stage returns: small, JSON-safe summaries (no PHI, no key material).

These are what Prefect stores as task results and what the run report renders, so they hold only
counts, digests, key ids, paths and metrics.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class DeidSummary(BaseModel):
    policy: str
    policy_version: str
    files_in: int
    files_out: int
    tags_changed: int
    rejected: int
    quarantined: int
    output_dir: Path
    manifest: Path


class CheckpointSummary(BaseModel):
    path: Path
    step: int
    sha256: str
    key_id: str | None = None


class TrainingSummary(BaseModel):
    device: str
    steps: int
    epochs_completed: int
    final_loss: float
    samples_per_second: float
    curve: list[tuple[int, float]] = Field(default_factory=list)  # (step, loss)
    checkpoints: list[CheckpointSummary] = Field(default_factory=list)


class HESummary(BaseModel):
    samples: int
    features: int
    max_abs_error: float
    plaintext_auc: float | None = None
    encrypted_auc: float | None = None
    plaintext_accuracy: float | None = None
    encrypted_accuracy: float | None = None
    ms_per_sample: float
    poly_modulus_degree: int
    public_context_bytes: int


class AuditSummary(BaseModel):
    url: str
    entries: int
    root_hash: str
    checkpoint_note: Path
    export_dir: Path
    verified: bool
    verifier_output: str = ""


class PipelineResult(BaseModel):
    run_dir: Path
    deid: DeidSummary
    training: TrainingSummary
    he: HESummary | None = None
    audit: AuditSummary | None = None
    curve_png: Path | None = None
    report_html: Path | None = None

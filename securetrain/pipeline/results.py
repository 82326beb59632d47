"""What each pipeline stage returns: small, JSON-safe summaries (no PHI, no key material).

These are what Prefect stores as task results and what the run report renders, so they hold only
counts, digests, key ids, paths and metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, computed_field, field_validator


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
    class_names: list[str] = Field(default_factory=list)  # id order
    train_files: int = 0
    eval_files: int = 0
    train_patients: int = 0
    eval_patients: int = 0
    train_class_counts: list[int] = Field(default_factory=list)
    eval_class_counts: list[int] = Field(default_factory=list)
    digests: dict[str, str] = Field(default_factory=dict)  # sha256 of manifests, policy digest
    refused_by_reason: dict[str, int] = Field(default_factory=dict)  # rejected + quarantined files per reason
    refusal_report: Path | None = None  # deid/refused.json when files were rejected or quarantined
    partial_accepted: bool = False  # files were quarantined and data.allow_quarantine let the run go on

    def refusal_note(self) -> str:
        """One phrase for summaries: why files were not written and where they are listed ("" if none)."""
        if self.refusal_report is None:
            return ""
        why = ("quarantined files accepted by data.allow_quarantine" if self.partial_accepted
               else "rejected by the policy")
        return f"{self.rejected + self.quarantined} files not written ({why}); refusal report: {self.refusal_report}"


class MaskingSummary(BaseModel):
    """Tabular masking + entity split (counts, digests, the policy's actions per column; no values)."""

    policy: str
    policy_version: str
    policy_digest: str
    key_id: str
    rows_in: int
    columns: dict[str, str]  # column -> action applied
    split_by: str
    train_rows: int
    eval_rows: int
    train_entities: int
    eval_entities: int
    class_names: list[str]  # tabular-regression: none
    train_class_counts: list[int]
    eval_class_counts: list[int]
    feature_columns: list[str]
    output_dir: Path
    digests: dict[str, str] = Field(default_factory=dict)  # input table, masked splits, policy


class PreparedData(BaseModel):
    """What the prepare stage (de-identify / mask / a custom task's prepare) produced."""

    task: str
    deid: DeidSummary | None = None
    masking: MaskingSummary | None = None
    details: dict[str, Any] = Field(default_factory=dict)  # a custom task's prepare() summary


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
    lr_curve: list[tuple[int, float]] = Field(default_factory=list)  # (step, learning rate)
    checkpoints: list[CheckpointSummary] = Field(default_factory=list)
    reason: str = "completed"  # completed | early_stopped | privacy_budget
    model_target: str = "cnn"
    parameters: int = 0
    class_names: list[str] = Field(default_factory=list)  # class id -> name (regression: none)
    task_kind: str = "classification"  # or "regression" (one output; rmse/mae/r2 metrics, no classes)
    # regression trained on standardised targets: {method, mean, std, samples} (outputs * std + mean)
    target_scaling: dict[str, Any] | None = None
    # the task's facts about its inputs, e.g. DICOM colour: {color_mode, requested, colour_files, grey_files, converted_to_grey}
    inputs: dict[str, Any] = Field(default_factory=dict)
    validation: list[dict[str, Any]] = Field(default_factory=list)  # per validation: epoch, step, loss, accuracy, auc, ...
    best: dict[str, Any] | None = None  # metric, value, epoch, step, checkpoint
    validation_metric: str | None = None  # training.validation.metric, the one ``best`` is chosen by
    best_checkpoint: CheckpointSummary | None = None
    world_size: int = 1  # training processes (torchrun nproc_per_node x nnodes)
    strategy: str = "single"  # single | ddp | fsdp
    profile_trace: Path | None = None  # torch.profiler Chrome trace (training.profile)
    memory: dict[str, Any] = Field(default_factory=dict)  # device memory summary at the end (main rank)
    privacy: dict[str, Any] | None = None  # DP-SGD runs: epsilon (spent), delta, target_epsilon, noise_multiplier, ...
    resumed_from: int | None = None  # the checkpoint step training continued from (None: a fresh start)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def label_map(self) -> dict[str, int]:
        """Class name -> class id (the ids the model's outputs are indexed by)."""
        return {name: i for i, name in enumerate(self.class_names)}


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
    scope: str = "head"  # head: the last linear layer on plaintext features; model: the whole model
    outputs: int = 1
    # max_abs_error is against the exact model; these split it into CKKS noise and the polynomials' share
    max_abs_error_vs_plan: float | None = None
    approximation_error: float | None = None
    out_of_interval_fraction: float | None = None
    packed: bool | None = None
    # fraction of samples whose encrypted decision (threshold / argmax) equals the plaintext model's
    prediction_agreement: float | None = None
    # regression (decrypted outputs un-standardised; every error here, max_abs_error included, in the
    # target's units): RMSE/MAE of the encrypted and plaintext predictions against the held-out targets,
    # and the encrypted predictions' RMSE against the plaintext ones (CKKS noise and rounding)
    task_kind: str = "classification"
    rmse_encrypted: float | None = None
    rmse_plaintext: float | None = None
    mae_encrypted: float | None = None
    mae_plaintext: float | None = None
    rmse_vs_plaintext: float | None = None


class AuditSummary(BaseModel):
    url: str  # password masked (``user:***@host``): this is printed, reported and stored by Prefect
    entries: int
    root_hash: str
    checkpoint_note: Path
    export_dir: Path
    verified: bool
    verifier_output: str = ""

    @field_validator("url")
    @classmethod
    def _mask_password(cls, value: str) -> str:
        from securetrain.redaction import mask_url

        return mask_url(value)

    @field_validator("verifier_output")
    @classmethod
    def _mask_urls(cls, value: str) -> str:
        from securetrain.redaction import mask_url

        return mask_url(value)


class RunInfo(BaseModel):
    """Provenance and timing of one run (shown at the top of the report)."""

    securetrain_version: str = ""
    source_commit: str | None = None  # git HEAD of the source checkout, or $SECURETRAIN_SOURCE_COMMIT
    flow_run_id: str | None = None  # Prefect flow run; None with --no-prefect
    started_at: str | None = None  # ISO 8601, UTC
    finished_at: str | None = None
    stage_seconds: dict[str, float] = Field(default_factory=dict)  # stage -> wall seconds, in order
    # Scheduled runs (pipeline.schedule): series, previous run, counts and digests of new inputs.
    input_changes: dict[str, Any] | None = None


class PipelineResult(BaseModel):
    """The whole run; also written to ``<run_dir>/result.json``."""

    run_dir: Path
    task: str = "dicom-classification"
    deid: DeidSummary | None = None
    masking: MaskingSummary | None = None
    data_details: dict[str, Any] = Field(default_factory=dict)
    training: TrainingSummary
    he: HESummary | None = None
    audit: AuditSummary | None = None
    curve_png: Path | None = None
    report_html: Path | None = None
    result_json: Path | None = None
    config_sha256: str | None = None
    run: RunInfo = Field(default_factory=RunInfo)
    # De-identification engine: {"task_runner" (the one used), "configured", "n_workers", "shard_size", "cluster"}
    execution: dict[str, Any] = Field(default_factory=dict)
    # Which keys the run used: ids and fingerprints (hashes that identify a key), never key material.
    keys: dict[str, str] = Field(default_factory=dict)
    provenance: dict[str, Any] | None = None  # path, statement_sha256, model_sha256, container_sha256, audit_tree_size, keyid

    # Shortcuts into ``training`` so result.json answers the common questions at the top level.
    @computed_field  # type: ignore[prop-decorator]
    @property
    def label_map(self) -> dict[str, int]:
        return self.training.label_map

    @computed_field  # type: ignore[prop-decorator]
    @property
    def model_target(self) -> str:
        return self.training.model_target

    @computed_field  # type: ignore[prop-decorator]
    @property
    def parameter_count(self) -> int:
        return self.training.parameters

    @computed_field  # type: ignore[prop-decorator]
    @property
    def validation(self) -> list[dict[str, Any]]:
        return self.training.validation

    @computed_field  # type: ignore[prop-decorator]
    @property
    def world_size(self) -> int:
        return self.training.world_size

    @computed_field  # type: ignore[prop-decorator]
    @property
    def checkpoint_paths(self) -> list[Path]:
        paths = [c.path for c in self.training.checkpoints]
        return paths + ([self.training.best_checkpoint.path] if self.training.best_checkpoint else [])

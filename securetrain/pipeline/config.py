"""``PipelineConfig``: one validated document describing a whole run.

YAML example (``examples/demo.yaml``)::

    name: demo
    output_dir: runs
    data: {synthetic: {n_patients: 8}, policy: policies/dicom-basic.yaml, image_size: 32}
    training: {epochs: 4, batch_size: 16}
    he: {enabled: true}

Environment overrides: ``SECURETRAIN_TRAINING__EPOCHS=2``. Paths that are relative are resolved
against the working directory, then against the config file's folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from securetrain.config.loader import load_model
from securetrain.errors import ConfigError
from securetrain.training.config import TrainingConfig


class SyntheticStudyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_patients: PositiveInt = 8
    studies_per_patient: PositiveInt = 2
    images_per_series: PositiveInt = 8
    image_size: PositiveInt = 32
    seed: int = Field(0, ge=0)
    include_burned_in: bool = True  # exercise the reject path in every demo
    blob_contrast: float = Field(1800.0, gt=0, description="Label-1 blob peak over noise sigma 60; lower is harder.")


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: Path | None = Field(None, description="DICOM folder or manifest CSV; None generates synthetic studies.")
    synthetic: SyntheticStudyConfig = Field(default_factory=SyntheticStudyConfig)
    policy: Path = Path("policies/dicom-basic.yaml")
    image_size: PositiveInt = 32
    eval_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="Share of patients held out for evaluation.")


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channels: PositiveInt = 8
    hidden: PositiveInt = 16


class HEConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    decimals: int = Field(5, ge=1, le=8, description="Decrypted scores are rounded to this many decimals.")


class SecretsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dir: Path | None = Field(None, description="Where run secrets live; default <run_dir>/keys.")
    create_demo_secrets: bool = Field(
        False,
        description="Create a keyring, its passphrase file and a de-identification secret when missing. "
        "For demos only: production supplies SECURETRAIN_KEYRING_PASSPHRASE and SECURETRAIN_DEID_KEY.",
    )


class AuditConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, description="SQLAlchemy URL or SQLite path; default $SECURETRAIN_AUDIT_URL, else <run_dir>/audit.db.")
    anchor_file: Path | None = Field(None, description="Append-only file receiving signed checkpoints.")
    signing_key: Path | None = Field(None, description="Ed25519 PEM key (0600); default $SECURETRAIN_AUDIT_KEY, else <keys dir>/audit-signing.pem.")


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    output_dir: Path = Path("runs")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=lambda: TrainingConfig(epochs=4, batch_size=16, checkpoint_every=10))
    he: HEConfig = Field(default_factory=HEConfig)
    # Not "keys": pydantic models with a keys attribute are mistaken for mappings by Prefect.
    secrets: SecretsConfig = Field(default_factory=SecretsConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)


    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.name


def _resolve(path: Path, base: Path | None) -> Path:
    if path.is_absolute() or path.exists() or base is None:
        return path
    candidate = base / path
    return candidate if candidate.exists() else path


def load_pipeline_config(
    path: str | os.PathLike[str] | None = None, *, data: dict | None = None
) -> PipelineConfig:
    """Load and validate a pipeline config (YAML/TOML + env overrides), resolving relative paths."""
    config = load_model(PipelineConfig, path, data=data)
    base = Path(path).resolve().parent if path is not None else None
    config.data.policy = _resolve(config.data.policy, base)
    if not config.data.policy.exists() and not config.data.policy.is_absolute():
        from securetrain.pipeline.locate import find_project_file

        config.data.policy = find_project_file(str(config.data.policy), required=False) or config.data.policy
    if config.data.source is not None:
        config.data.source = _resolve(config.data.source, base)
        if not config.data.source.exists():
            raise ConfigError(f"data.source: {config.data.source} does not exist")
    if not config.data.policy.is_file():
        raise ConfigError(f"data.policy: policy file {config.data.policy} not found", hint="run from the repository root or give an absolute path")
    return config

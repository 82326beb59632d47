"""``PipelineConfig``: one validated document describing a whole run.

YAML example (``examples/demo.yaml``)::

    name: demo
    output_dir: runs
    task: dicom-classification          # or tabular-classification, tabular-regression, or {target: "pkg.mod:make_task"}
    data: {synthetic: {n_patients: 8}, policy: policies/dicom-basic.yaml, image_size: 32}
    model: {target: cnn, kwargs: {channels: 8, hidden: 16}}   # or "mypkg.nets:build"
    training: {epochs: 4, batch_size: 16, scheduler: {name: cosine, warmup_steps: 5}}
    he: {enabled: true}

Environment overrides: ``SECURETRAIN_TRAINING__EPOCHS=2``. Relative paths of files the run reads
(``data.source``, ``data.policy``, ``audit.signing_key``, ``audit.anchor_file``, ``secrets.dir``,
``release.policy``) are resolved against the working directory, then against the config file's
folder (where they exist); ``output_dir`` is relative to the working directory. ``model.target``
and ``task.target`` modules import from the config file's folder first.
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

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


class SyntheticTableConfig(BaseModel):
    """The synthetic transactions table (PII columns, a fraud label) used when ``data.source`` is unset."""

    model_config = ConfigDict(extra="forbid")
    rows: PositiveInt = 2000
    customers: PositiveInt | None = Field(400, description="Distinct customers (rows share them); None: one per row.")
    seed: int = Field(0, ge=0)


def canonical_label(value: str) -> str:
    """``"01"`` and ``"1"`` are the same class; strings are kept as written (stripped)."""
    value = value.strip()
    try:
        return str(int(value))
    except ValueError:
        return value


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: Path | None = Field(
        None,
        description="DICOM: manifest CSV (path,label). Tables: CSV/Parquet file. None generates synthetic data.",
    )
    synthetic: SyntheticStudyConfig = Field(default_factory=SyntheticStudyConfig)
    synthetic_table: SyntheticTableConfig = Field(default_factory=SyntheticTableConfig)
    policy: Path | None = Field(None, description="De-identification (DICOM) or masking (tables) policy; "
                                "default policies/dicom-basic.yaml for DICOM, required for tables.")
    image_size: PositiveInt = 32
    allow_quarantine: bool = Field(
        False, description="DICOM: train on what de-identification wrote even when input files were quarantined "
        "(could not be processed: unreadable, truncated, not DICOM). false: such a run fails with exit 65 before "
        "training. Files the policy rejects (burned-in text, no patient identity) never fail a run; rejected and "
        "quarantined files alike are listed in deid/refused.json.")
    eval_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="Share of patients/entities held out for evaluation.")
    label_column: str = Field("label", description="Manifest/table column holding the class label "
                              "(tabular-regression: the numeric target, e.g. loss_amount).")
    target_scaling: Literal["standard", "none"] = Field(
        "standard", description="Regression: standard trains on (target - mean) / std, fitted on the training "
        "split only; predictions, RMSE and MAE are restored to the target's units (the scaling is saved as "
        "<run_dir>/train/target-scaling.json). none: train on the raw targets.")
    classes: list[str] | None = Field(
        None, description="Class names in id order; default: the sorted distinct labels (integers numerically)."
    )
    @field_validator("classes", mode="before")
    @classmethod
    def _canonical_classes(cls, value: Any) -> Any:
        # The labels' rules: YAML integers are class names too, and "01" is "1" (canonical_label).
        if not isinstance(value, list):
            return value
        names = [canonical_label(str(v)) if isinstance(v, (str, int)) and not isinstance(v, bool) else v
                 for v in value]
        repeated = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
        if repeated:
            raise ValueError(f"data.classes names {', '.join(map(repr, repeated))} more than once "
                             "(integer labels count as one class however written: 01 is 1)")
        return names

    frames: Literal["first", "middle", "all"] | int = Field(
        "first", description="Multi-frame DICOM: which frame (index, first, middle), or all frames stacked.")
    depth: PositiveInt | None = Field(None, description="frames: all -> resample every file to this many frames.")
    frames_as: Literal["channels", "depth"] = Field("channels", description="frames: all -> [F,H,W] or [1,F,H,W].")
    color_mode: Literal["grey", "rgb", "auto"] = Field(
        "grey", description="DICOM colour (RGB, YBR_FULL, YBR_FULL_422; 3 samples per pixel): grey averages R, G, "
        "B into one channel (stated in the log and report); rgb keeps [3,H,W] and refuses a grey file; auto: rgb "
        "when every file is colour, else grey.")
    split_by: str | None = Field(
        None, description="Tables: the entity column (e.g. customer_id); the policy must tokenise it. "
        "No entity is on both sides of the split. Default: the one tokenised column named id or *_id.")
    features: list[str] | None = Field(None, description="Tables: feature columns; default every kept/generalised column.")
    max_categories: PositiveInt = Field(32, description="Tables: one-hot width cap per categorical column (+1 'other').")


class ModelConfig(BaseModel):
    """``target``: a built-in name (cnn, mlp, logistic), an entry point, or ``package.module:callable``."""

    model_config = ConfigDict(extra="forbid")
    target: str = Field("cnn", min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _legacy_cnn_fields(cls, data: Any) -> Any:
        # `model: {channels: 8, hidden: 16}` (the earlier schema) still configures the built-in CNN.
        if isinstance(data, dict) and ({"channels", "hidden"} & set(data)):
            data = dict(data)
            legacy = {k: data.pop(k) for k in ("channels", "hidden") if k in data}
            data["kwargs"] = {**legacy, **dict(data.get("kwargs") or {})}
        return data


TaskKind = Literal["dicom-classification", "tabular-classification", "tabular-regression", "custom"]
#: Built-in tasks reading a masked table (the masking key, policy and entity split rules).
TABULAR_KINDS = ("tabular-classification", "tabular-regression")
#: Validation metrics of a regression task (:func:`securetrain.training.validation.regression_metrics`).
REGRESSION_METRICS = ("rmse", "mae", "loss", "r2")


class TaskConfig(BaseModel):
    """``task: dicom-classification`` | ``tabular-classification`` | ``tabular-regression`` | ``{target: "pkg.mod:make_task", kwargs}``."""

    model_config = ConfigDict(extra="forbid")
    kind: TaskKind = "dicom-classification"
    target: str | None = Field(None, description="Custom task factory 'package.module:callable' (see docs/tasks.md).")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"kind": "custom", "target": data} if ":" in data else {"kind": data}
        if isinstance(data, dict) and data.get("target") and "kind" not in data:
            return {**data, "kind": "custom"}
        return data

    @model_validator(mode="after")
    def _custom_needs_target(self) -> TaskConfig:
        if (self.kind == "custom") != (self.target is not None):
            raise ValueError("a custom task needs task.target ('package.module:callable'), and only a custom task takes one")
        return self


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mlflow_uri: str | None = Field(None, description="Log params/metrics to MLflow here, e.g. sqlite:///mlflow.db "
                                   "or http://mlflow:5000 (needs the [mlflow] extra).")
    experiment: str = "securetrain"
    artifact_location: str | None = Field(None, description="For a new experiment; default <output_dir>/mlflow-artifacts.")


class ExecutionConfig(BaseModel):
    """Where de-identification runs: shards of the manifest as Prefect tasks on an existing engine.

    ``serial`` runs the shards one after another in the pipeline's process (also what ``--no-prefect``
    does for every runner); ``thread`` uses Prefect's ThreadPoolTaskRunner, ``process`` its
    ProcessPoolTaskRunner (``n_workers`` local processes: de-identification is CPU-bound Python, so
    threads share one core through the GIL); ``dask`` and ``ray`` use
    ``prefect-dask`` / ``prefect-ray`` (extras ``[dask]`` / ``[ray]``): a local cluster of
    ``n_workers`` processes, or the existing cluster at ``address``. Outputs are byte-identical
    whichever runner is used, and a rerun skips shards whose outputs exist and verify.
    """

    model_config = ConfigDict(extra="forbid")
    task_runner: Literal["serial", "thread", "process", "dask", "ray"] = "serial"
    address: str | None = Field(None, description="scheduler/cluster address (dask: tcp://host:8786, ray: ray://host:10001)")
    n_workers: PositiveInt = 2
    shard_size: PositiveInt = Field(256, description="files per shard (one retriable task each)")

    @model_validator(mode="after")
    def _address_needs_a_cluster_runner(self) -> ExecutionConfig:
        if self.address and self.task_runner not in ("dask", "ray"):
            raise ValueError(f"execution.address is for the dask and ray runners, not {self.task_runner!r}")
        return self


class HEConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="Score the trained model under CKKS (classifiers: AUC/accuracy; "
                          "regression: RMSE/MAE in the target's units). tabular-regression turns it off unless set.")
    scope: Literal["auto", "head", "model"] = Field(
        "auto", description="head: the last linear layer on plaintext features; model: the whole model "
        "(tabular MLP/logistic; hidden activations become polynomials); auto: the whole model for tables "
        "when HE computes it exactly (no hidden activation, e.g. logistic), the last linear layer otherwise.")
    checkpoint: Literal["best", "last"] = Field("best", description="Which weights are scored: the best validation's or the last.")
    decimals: int = Field(5, ge=1, le=8, description="Decrypted scores are rounded to this many decimals.")


class SecretsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dir: Path | None = Field(None, description="Where run secrets live; default <run_dir>/keys.")
    create_demo_secrets: bool = Field(
        False,
        description="Create a keyring, its passphrase file and a de-identification secret when missing. "
        "For demos only: production supplies SECURETRAIN_KEYRING_PASSPHRASE and SECURETRAIN_DEID_KEY.",
    )
    demo_deid_key: Literal["random", "fixed"] = Field(
        "random",
        description="With create_demo_secrets: 'fixed' uses the public demo de-identification key, so a demo's "
        "pseudonyms, patient split and metrics repeat run to run. Anyone can recompute pseudonyms made with "
        "it: synthetic data only.",
    )

    @model_validator(mode="after")
    def _fixed_key_is_for_demos(self) -> SecretsConfig:
        if self.demo_deid_key == "fixed" and not self.create_demo_secrets:
            raise ValueError("secrets.demo_deid_key 'fixed' is for demos (create_demo_secrets: true) only")
        return self


class AuditConfig(BaseModel):
    # populate_by_name: a dumped config (run-config.json: field names) loads back as well as YAML (alias).
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    url: str | None = Field(None, description="SQLAlchemy URL or SQLite path; default $SECURETRAIN_AUDIT_URL, else <run_dir>/audit.db.")
    schema_name: str | None = Field(None, alias="schema", pattern=r"^[A-Za-z0-9_]{1,63}$",
                                    description="PostgreSQL schema holding the log (default securetrain_audit); "
                                    "ignored for SQLite.")
    anchor_file: Path | None = Field(None, description="Append-only file receiving signed checkpoints.")
    signing_key: Path | None = Field(None, description="Ed25519 PEM key (0600); default $SECURETRAIN_AUDIT_KEY, else <keys dir>/audit-signing.pem.")
    origin: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,254}$",
                               description="The log's name in its signed checkpoints. Default: securetrain/<name> for "
                               "the run's own log (<run_dir>/audit.db); for a shared log (audit.url or "
                               "$SECURETRAIN_AUDIT_URL) the origin its checkpoints already carry, else one derived "
                               "from the signing key. One log has one origin, whatever the runs writing to it.")


class ReleaseConfig(BaseModel):
    """Signed provenance at the end of a run, and the optional release step (docs/release.md)."""

    model_config = ConfigDict(extra="forbid")
    provenance: bool = Field(True, description="Sign an in-toto provenance statement (DSSE, Ed25519) for the trained model.")
    await_approval: bool = Field(False, description="Prefect flow: end with a release step that suspends at "
                                 "'awaiting approval' until policies/release.yaml holds, then exports the model.")
    policy: Path | None = Field(None, description="Release policy; default policies/release.yaml.")
    export_to: Path | None = Field(None, description="Where the release step writes the model; default <run_dir>/release/model.safetensors.")
    approval_timeout_s: PositiveInt = Field(7 * 24 * 3600, description="How long the paused/suspended flow waits for approvals.")


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    output_dir: Path = Path("runs")
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=lambda: TrainingConfig(epochs=4, batch_size=16, checkpoint_every=10))
    he: HEConfig = Field(default_factory=HEConfig)
    # Not "keys": pydantic models with a keys attribute are mistaken for mappings by Prefect.
    secrets: SecretsConfig = Field(default_factory=SecretsConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    release: ReleaseConfig = Field(default_factory=ReleaseConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    base_dir: Path | None = Field(None, description="Set by the loader: the config file's folder (imports start there).")
    series: str | None = Field(None, description="Set for scheduled runs (securetrain.pipeline.schedule): the "
                               "config's own name; each run of the series has its own run folder.")

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.name


def _resolve(path: Path, base: Path | None) -> Path:
    if path.is_absolute() or path.exists() or base is None:
        return path
    candidate = base / path
    return candidate if candidate.exists() else path


def regression_defaults(config: PipelineConfig) -> None:
    """A regression task's settings: ``rmse`` selects the best checkpoint unless
    ``training.validation.metric`` is set; HE scoring is off unless ``he.enabled`` is set (an
    opt-in: it costs keys and ciphertexts); ``data.classes`` has no meaning and is refused."""
    if config.data.classes is not None:
        raise ConfigError("data.classes: a regression task has no classes",
                          hint="remove data.classes, or use tabular-classification for class labels")
    if "metric" not in config.training.validation.model_fields_set:
        config.training.validation.metric = "rmse"
        config.training.validation.model_fields_set.discard("metric")  # still the task's default
    if "enabled" not in config.he.model_fields_set:
        config.he.enabled = False
        config.he.model_fields_set.discard("enabled")


def load_pipeline_config(
    path: str | os.PathLike[str] | None = None, *, data: dict | None = None
) -> PipelineConfig:
    """Load and validate a pipeline config (YAML/TOML + env overrides), resolving relative paths."""
    config = load_model(PipelineConfig, path, data=data)
    base = Path(path).resolve().parent if path is not None else None
    if config.base_dir is None:
        config.base_dir = base
    kind = config.task.kind
    if config.data.policy is None and kind == "dicom-classification":
        config.data.policy = Path("policies/dicom-basic.yaml")
    if config.data.policy is None and kind in TABULAR_KINDS:
        raise ConfigError("data.policy: a tabular task needs a masking policy",
                          hint="e.g. policy: policies/finance-pii.yaml (unknown columns then fail closed)")
    if kind == "tabular-regression":
        regression_defaults(config)
    if config.data.policy is not None:
        config.data.policy = _resolve(config.data.policy, base)
        if not config.data.policy.exists() and not config.data.policy.is_absolute():
            from securetrain.pipeline.locate import find_project_file

            config.data.policy = find_project_file(str(config.data.policy), required=False) or config.data.policy
        if not config.data.policy.is_file():
            raise ConfigError(f"data.policy: policy file {config.data.policy} not found",
                              hint="run from the repository root or give an absolute path")
    # Files the run reads (keys, the release policy, the keys folder, an existing anchor file):
    # relative to the working directory, else to the config file's folder, like data.source.
    if config.audit.signing_key is not None:
        config.audit.signing_key = _resolve(config.audit.signing_key, base)
    if config.audit.anchor_file is not None:
        config.audit.anchor_file = _resolve(config.audit.anchor_file, base)
    if config.secrets.dir is not None:
        config.secrets.dir = _resolve(config.secrets.dir, base)
    if config.release.policy is not None:
        config.release.policy = _resolve(config.release.policy, base)
    if config.data.source is not None:
        config.data.source = _resolve(config.data.source, base)
        if not config.data.source.exists():
            raise ConfigError(f"data.source: {config.data.source} does not exist")
    return config

"""``TrainingConfig``: every knob of the engine, validated by pydantic.

Load from YAML/TOML with :func:`securetrain.config.loader.load_model` (env overrides like
``SECURETRAIN_TRAINING__MAX_STEPS=100`` work there).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

Precision = Literal["auto", "bf16", "fp16", "fp32"]
SchedulerName = Literal["none", "constant", "cosine", "step", "onecycle"]


class SchedulerConfig(BaseModel):
    """A learning-rate schedule from ``torch.optim.lr_scheduler``, stepped once per optimizer step.

    ``cosine``: CosineAnnealingLR down to ``min_lr`` over the run; ``step``: StepLR, lr x ``gamma``
    every ``step_epochs`` epochs (or ``step_steps`` steps); ``onecycle``: OneCycleLR peaking at
    ``lr``. ``warmup_steps`` / ``warmup_epochs`` prepend a linear warm-up from ``warmup_start_factor``
    x lr (for ``onecycle`` the warm-up sets its rising phase). Its state is checkpointed, so a resumed
    run continues the schedule exactly.
    """

    model_config = ConfigDict(extra="forbid")

    name: SchedulerName = "none"
    warmup_steps: int = Field(0, ge=0)
    warmup_epochs: float = Field(0.0, ge=0.0, description="Warm-up length in epochs (added to warmup_steps).")
    warmup_start_factor: float = Field(0.1, gt=0.0, le=1.0)
    min_lr: float = Field(0.0, ge=0.0, description="cosine: the final learning rate.")
    step_epochs: PositiveInt | None = Field(None, description="step: decay every N epochs.")
    step_steps: PositiveInt | None = Field(None, description="step: decay every N optimizer steps.")
    gamma: float = Field(0.1, gt=0.0, le=1.0, description="step: multiplicative decay.")


class OptimizerConfig(BaseModel):
    """``training.optimizer``: a ``torch.optim`` optimizer by class name (case-insensitive: ``adamw``,
    ``sgd``, ``adam``, ``rmsprop``, ``lbfgs``, ...). ``lr`` and ``weight_decay`` come from the
    training section (when the class takes them); ``kwargs`` are its other arguments
    (``{momentum: 0.9, nesterov: true}``, ``{betas: [0.9, 0.99]}``, ``{max_iter: 5}``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("adamw", pattern=r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
    kwargs: dict[str, Any] = Field(default_factory=dict)


#: Parts of a metric name that mean "lower is better" (validation.mode auto minimises them).
LOWER_IS_BETTER = ("loss", "error", "err", "mae", "mse", "rmse", "msle", "mape", "smape", "mad", "brier",
                   "perplexity", "nll", "distance", "hausdorff", "fpr", "fnr", "miss", "cost", "regret")


def lower_is_better(metric: str) -> bool:
    """Whether ``mode: auto`` minimises ``metric``: a name containing ``loss`` or ``error``, or a
    part (split at ``_``, ``-``, ``.``, ``/``) naming an error measure (``mae``, ``val_rmse``, ``brier``)."""
    name = metric.lower()
    if "loss" in name or "error" in name:
        return True
    parts = set(re.split(r"[_\-./ ]+", name))
    return bool(parts & set(LOWER_IS_BETTER))


class ValidationConfig(BaseModel):
    """Validation on held-out data after every ``every_epochs`` epochs (when eval data is given)."""

    model_config = ConfigDict(extra="forbid")

    every_epochs: PositiveInt = 1
    metric: str = Field("loss", description="Metric that selects the best checkpoint: loss, accuracy, auc, "
                        "or a custom task metric (pipeline regression tasks: rmse by default; mae, r2).")
    mode: Literal["auto", "min", "max"] = Field(
        "auto", description="auto: min for losses and error measures (loss, mae, rmse, brier, ...), max otherwise.")
    patience: PositiveInt | None = Field(None, description="Stop after this many validations without improvement.")
    min_delta: float = Field(0.0, ge=0.0, description="Smallest change that counts as an improvement.")
    batch_size: PositiveInt | None = Field(None, description="Default: training batch_size.")

    @property
    def maximize(self) -> bool:
        if self.mode != "auto":
            return self.mode == "max"
        return not lower_is_better(self.metric)


class RendezvousConfig(BaseModel):
    """torchrun rendezvous (``--rdzv-backend/--rdzv-endpoint/--rdzv-id``) for ``nnodes > 1``."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field("c10d", pattern=r"^[A-Za-z0-9_-]{1,32}$", description="torchrun --rdzv-backend.")
    endpoint: str | None = Field(None, pattern=r"^[A-Za-z0-9._\[\]:-]{1,255}$",
                                 description="host:port every node reaches (the c10d store host).")
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,128}$", description="Job id shared by all nodes.")
    timeout_s: PositiveInt | None = Field(None, description="Rendezvous join timeout (torchrun --rdzv-conf join_timeout).")


class ProfileConfig(BaseModel):
    """``training.profile: {steps: N}``: a torch.profiler Chrome trace of N optimizer steps (main rank)."""

    model_config = ConfigDict(extra="forbid")

    steps: PositiveInt = Field(5, description="Optimizer steps recorded (after `wait` steps).")
    wait: int = Field(1, ge=0, description="Steps skipped first (warm-up, data loader start).")


class PrivacyConfig(BaseModel):
    """Differential privacy (DP-SGD, Opacus): the run's (epsilon, delta) budget.

    The noise multiplier is chosen by Opacus' ``make_private_with_epsilon`` so that ``plan_epochs``
    (default: ``epochs``, or ``max_steps`` worth of epochs) spend at most ``target_epsilon``; training stops
    before any step that would exceed it. Per-sample clipping at ``max_grad_norm`` replaces
    ``grad_clip``; batches are Poisson-sampled with expected size ``batch_size x grad_accumulation``.
    """

    model_config = ConfigDict(extra="forbid")

    target_epsilon: PositiveFloat
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="Target delta; keep it well below 1/len(dataset).")
    max_grad_norm: PositiveFloat = Field(1.0, description="Per-sample gradient clipping bound.")
    accountant: Literal["rdp", "prv", "gdp"] = "rdp"
    plan_epochs: PositiveInt | None = Field(None, description="Epochs the noise is planned for (default: the run's).")
    fix_model: bool = Field(True, description="Replace DP-incompatible layers (BatchNorm -> GroupNorm) with Opacus' ModuleValidator.fix.")


class TrainingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: PositiveInt | None = Field(1, description="Passes over the data; None = until max_steps.")
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps (wins over epochs).")
    batch_size: PositiveInt = Field(32, description="Per-process micro-batch size.")
    lr: PositiveFloat = 1e-3
    optimizer: OptimizerConfig | None = Field(
        None, description="A torch.optim optimizer by name with its kwargs; None: AdamW(lr, weight_decay).")
    weight_decay: float = Field(0.0, ge=0.0)
    seed: int = Field(0, ge=0, lt=2**32)
    precision: Precision = "auto"
    grad_clip: PositiveFloat | None = Field(1.0, description="Max global grad norm; None disables clipping.")
    class_weights: list[PositiveFloat] | Literal["balanced"] | None = Field(
        None, description="Per-class weights of the default cross-entropy loss (one per class, in class-id order), "
        "or 'balanced': samples / (classes x samples of the class), counted on the training labels.")
    grad_accumulation: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    closure: bool | None = Field(
        None, description="Call optimizer.step(closure) with a closure that recomputes the loss and gradients "
        "of the step's micro-batches (LBFGS). None: when the optimizer's step requires a closure argument.")
    checkpoint_every: PositiveInt | None = Field(None, description="Checkpoint every N optimizer steps.")
    checkpoint_at_end: bool = True
    keep_last: PositiveInt | None = Field(3, description="Checkpoints kept by the default store; None keeps all.")
    resume: bool = Field(True, description="Continue from the latest checkpoint in the store if there is one.")
    device: str = "auto"
    output_dir: Path = Path("runs/train")
    log_every: PositiveInt = Field(10, description="Sync loss to host and call on_step every N steps.")
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int | None = Field(
        None, ge=0, description="DataLoader workers per rank; None: the device backend's advice (~70% of the "
        "cores per rank, capped; 0 when the data is already in memory is still allowed by setting 0).")
    batch_multiple: Literal["auto", "off"] = Field(
        "auto", description="auto: round batch_size up to the device backend's preferred multiple (logged).")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Multi-process wrapping: ddp (replicated, rank 0 writes one checkpoint) or fsdp "
        "(FSDP2 fully_shard, every rank writes its own encrypted shard).")
    find_unused_parameters: bool = Field(
        False, description="strategy ddp: let DistributedDataParallel find parameters that get no gradient in a "
        "step (a model with an unused or conditionally used branch); costs a graph traversal per step.")
    stop_check_every: PositiveInt = Field(
        10, description="Multi-process: all-reduce the stop (preemption) flag every N optimizer steps "
        "(and at every checkpoint), not every step.")
    profile: ProfileConfig | None = Field(None, description="Record a torch.profiler Chrome trace under output_dir.")
    nproc_per_node: PositiveInt = Field(1, description="Pipeline: processes per node; > 1 launches torchrun.")
    nnodes: PositiveInt = Field(1, description="Pipeline: nodes in the torchrun job (> 1 needs rdzv.endpoint).")
    node_rank: int | None = Field(None, ge=0, description="Static rendezvous: this node's rank (torchrun --node-rank).")
    rdzv: RendezvousConfig = Field(default_factory=RendezvousConfig)
    deterministic: bool = Field(False, description="torch.use_deterministic_algorithms (slower on GPU).")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    privacy: PrivacyConfig | None = Field(None, description="DP-SGD through Opacus (securetrain.release.privacy); None = off.")

    @model_validator(mode="after")
    def _has_a_stop(self) -> TrainingConfig:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set epochs or max_steps (or both: training stops at whichever comes first)")
        if self.nnodes > 1 and not self.rdzv.endpoint:
            raise ValueError("nnodes > 1 needs rdzv.endpoint (host:port of the rendezvous store every node reaches)")
        if self.strategy == "fsdp" and getattr(self, "privacy", None) is not None:
            raise ValueError("privacy (DP-SGD) works with strategy ddp only (Opacus wraps the model in its DDP)")
        if isinstance(self.class_weights, list) and len(self.class_weights) < 2:
            raise ValueError("class_weights needs one weight per class (at least 2), or 'balanced'")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        return self

    @property
    def launch_world_size(self) -> int:
        """Processes the pipeline launches through torchrun (1: train in-process)."""
        return self.nproc_per_node * self.nnodes

"""Hooks the trainer calls so pipelines can plot curves, log, or show progress without subclassing.

Callbacks run on rank 0 only (the other ranks do identical work), and ``on_step`` is called every
``log_every`` optimizer steps and on the final step: that is when the loss is synced to the host,
so callbacks never force an extra device sync.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from securetrain.training.checkpoint_store import CheckpointInfo

if TYPE_CHECKING:
    from securetrain.training.trainer import Trainer, TrainResult


@dataclass(frozen=True)
class StepMetrics:
    step: int  # optimizer steps done so far
    epoch: int
    loss: float  # mean loss over the micro-batches since the previous on_step
    samples_per_s: float  # global (all ranks) throughput over that window
    lr: float
    memory: dict[str, Any] = field(default_factory=dict)  # DeviceBackend.memory_summary()
    total_steps: int | None = None  # known when max_steps or a sized dataset bound the run


class TrainerCallback:
    """Override any subset."""

    def on_train_begin(self, trainer: Trainer) -> None: ...

    def on_step(self, trainer: Trainer, metrics: StepMetrics) -> None: ...

    def on_checkpoint(self, trainer: Trainer, info: CheckpointInfo) -> None: ...

    def on_validation(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """After each validation: ``epoch``, ``step`` and the task's metrics (loss, accuracy, auc, ...)."""

    def on_end(self, trainer: Trainer, result: TrainResult) -> None: ...

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        """Training is aborting with ``error`` (re-raised after all callbacks ran)."""


class MetricsHistory(TrainerCallback):
    """Keeps every :class:`StepMetrics` and validation (what the pipeline draws its curves from).

    Stateful: the trainer saves its history in each checkpoint, so the curves of a resumed run
    start at step 1, not at the resume point.
    """

    def __init__(self) -> None:
        self.history: list[StepMetrics] = []
        self.validations: list[dict[str, Any]] = []
        self.checkpoints: list[CheckpointInfo] = []

    def on_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.history.append(metrics)

    def on_validation(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.validations.append(dict(metrics))

    def state_dict(self) -> dict[str, Any]:
        steps = [{k: v for k, v in asdict(m).items() if k != "memory"} for m in self.history]
        return {"steps": steps, "validations": self.validations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [StepMetrics(**m) for m in state.get("steps", [])]
        self.validations = list(state.get("validations", []))

    def on_checkpoint(self, trainer: Trainer, info: CheckpointInfo) -> None:
        self.checkpoints.append(info)

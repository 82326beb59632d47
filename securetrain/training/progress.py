"""A rich progress-bar callback for the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from securetrain.cli.console import progress_bar
from securetrain.training.callbacks import StepMetrics, TrainerCallback
from securetrain.training.checkpoint_store import CheckpointInfo

if TYPE_CHECKING:
    from securetrain.training.trainer import Trainer, TrainResult


class RichProgressCallback(TrainerCallback):
    def __init__(self, description: str = "training", *, disable: bool = False) -> None:
        self.description = description
        self.disable = disable
        self._progress: Any = None
        self._task: Any = None

    def on_train_begin(self, trainer: Trainer) -> None:
        self._progress = progress_bar(disable=self.disable)
        self._progress.start()
        total = getattr(trainer, "_total_steps", None) or trainer.config.max_steps
        self._task = self._progress.add_task(self.description, total=total, completed=trainer.progress.step, status="")

    def on_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if self._progress is None:
            return
        if metrics.total_steps is not None:
            self._progress.update(self._task, total=metrics.total_steps)
        self._progress.update(
            self._task, completed=metrics.step,
            status=f"loss {metrics.loss:.4f} · {metrics.samples_per_s:,.0f} samples/s · epoch {metrics.epoch}",
        )

    def on_checkpoint(self, trainer: Trainer, info: CheckpointInfo) -> None:
        if self._progress is not None:
            self._progress.console.print(f"checkpoint step {info.step} → {info.path}", highlight=False)

    def on_end(self, trainer: Trainer, result: TrainResult) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=result.steps)
            self._progress.stop()
            self._progress = None

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

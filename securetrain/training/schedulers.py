"""Learning-rate schedules by name, built from ``torch.optim.lr_scheduler``.

The trainer steps the schedule once per optimizer step, so every length here is in optimizer steps
(epoch-based settings are converted with the number of steps per epoch). Schedulers' state dicts
are plain numbers and strings, which the trainer stores in the checkpoint's JSON state.
"""

from __future__ import annotations

import math

import torch
from torch.optim import lr_scheduler as sched

from securetrain.training.config import SchedulerConfig
from securetrain.training.errors import TrainingError


def build_scheduler(
    config: SchedulerConfig,
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int | None,
    steps_per_epoch: int | None,
) -> sched.LRScheduler | None:
    """The schedule ``config`` names for ``optimizer`` (``None`` for ``none``/``constant``)."""
    name = config.name
    if name in ("none", "constant") and not (config.warmup_steps or config.warmup_epochs):
        return None
    warmup = config.warmup_steps + _epochs_to_steps(config.warmup_epochs, steps_per_epoch, "warmup_epochs")
    if name == "onecycle":
        total = _need_total(total_steps, name)
        pct = min(max(warmup / total, 1.0 / total), 0.99) if warmup else 0.3
        max_lr = [g["lr"] for g in optimizer.param_groups]
        return sched.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total, pct_start=pct,
                                div_factor=1.0 / config.warmup_start_factor, anneal_strategy="cos")
    if name == "cosine":
        total = _need_total(total_steps, name)
        main: sched.LRScheduler = sched.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup), eta_min=config.min_lr)
    elif name == "step":
        every = config.step_steps or (
            _epochs_to_steps(config.step_epochs, steps_per_epoch, "step_epochs") if config.step_epochs else None
        )
        if not every:
            raise TrainingError("the step scheduler needs step_epochs or step_steps", hint="e.g. scheduler: {name: step, step_epochs: 5}")
        main = sched.StepLR(optimizer, step_size=every, gamma=config.gamma)
    else:  # constant after warm-up
        main = sched.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if not warmup:
        return main
    ramp = sched.LinearLR(optimizer, start_factor=config.warmup_start_factor, end_factor=1.0, total_iters=warmup)
    return sched.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def _need_total(total_steps: int | None, name: str) -> int:
    if not total_steps:
        raise TrainingError(f"the {name} scheduler needs a known run length",
                            hint="set max_steps, or epochs with a sized dataset")
    return total_steps


def _epochs_to_steps(epochs: float, steps_per_epoch: int | None, what: str) -> int:
    if not epochs:
        return 0
    if steps_per_epoch is None:
        raise TrainingError(f"scheduler.{what} needs a sized dataset", hint="give the length in steps instead")
    return max(1, math.ceil(epochs * steps_per_epoch))

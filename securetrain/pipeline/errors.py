"""Typed errors of the pipeline: a bad model or task target, a model that does not fit the task."""

from __future__ import annotations

from securetrain.errors import ConfigError, SecureTrainError


class PipelineError(SecureTrainError):
    """The pipeline cannot run as configured."""


class ModelTargetError(PipelineError, ConfigError):
    """``model.target`` does not import, is not callable, or does not return an ``nn.Module``."""


class ModelOutputError(PipelineError):
    """The model's output on one real batch does not match the task (e.g. number of classes)."""


class TaskError(PipelineError, ConfigError):
    """``task`` / ``task.target`` is unknown, or the task's data cannot be used as configured."""


class SigningKeyError(PipelineError, ConfigError):
    """A signing key the run needs (provenance) is missing, unsafe or not an Ed25519 PEM key."""


#: Exit status of ``securetrain run``/``demo`` after a preemption (same as ``securetrain train``).
PREEMPTED_EXIT_CODE = 75


class PipelinePreempted(PipelineError):
    """Training stopped on SIGTERM or Ctrl-C after a clean checkpoint; rerunning resumes it.

    ``exit_code``: 75 after SIGTERM, 130 after Ctrl-C (what ``securetrain train`` exits with).
    """

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int = PREEMPTED_EXIT_CODE,
                 steps: int | None = None) -> None:
        super().__init__(message, hint=hint)
        self.exit_code = exit_code
        self.steps = steps  # optimizer steps done (when known)

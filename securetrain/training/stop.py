"""Why a training run stopped (torch-free, so the CLI, pipeline and reports can import it cheaply)."""

from __future__ import annotations

from enum import StrEnum


class StopReason(StrEnum):
    """The reason in :class:`~securetrain.training.TrainResult`, ``result.json`` and the audit log.

    A :class:`~enum.StrEnum`: members compare equal to (and serialise as) their value, so
    ``result.reason == "preempted"`` and JSON output are unchanged from the plain strings.
    """

    COMPLETED = "completed"  # epochs or max_steps reached
    PREEMPTED = "preempted"  # a stop signal (SIGTERM/SIGINT) was honoured after a step
    EARLY_STOPPED = "early_stopped"  # validation patience ran out
    PRIVACY_BUDGET = "privacy_budget"  # DP-SGD: the next step would exceed the target epsilon

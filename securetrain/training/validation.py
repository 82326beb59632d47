"""Validation on held-out data: classification metrics, best-metric tracking, early stopping.

:func:`classification_metrics` turns collected logits and integer targets into loss, accuracy,
macro one-vs-rest AUC, per-class counts and the confusion matrix. :class:`BestTracker` remembers
the best value of one named metric and how many validations passed without improvement; its
state is plain JSON, saved in every training checkpoint so early stopping resumes exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from securetrain.metrics import binary_auc
from securetrain.training.errors import TrainingError

#: ``metrics_fn(logits, targets) -> {name: value}``; values are floats, ints or lists of them.
MetricsFn = Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]


def macro_auc(probabilities: np.ndarray, targets: np.ndarray) -> float | None:
    """Macro one-vs-rest AUC over the classes present in ``targets`` (binary: AUC of class 1)."""
    n_classes = probabilities.shape[1]
    if n_classes == 2:
        return binary_auc(probabilities[:, 1], targets == 1)
    aucs = [a for c in range(n_classes) if (a := binary_auc(probabilities[:, c], targets == c)) is not None]
    return float(np.mean(aucs)) if aucs else None


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """loss (mean cross-entropy), accuracy, auc (macro OvR), class_counts, predicted_counts, confusion."""
    fractional = targets.is_floating_point() and not torch.equal(targets, targets.round())  # 0./1. are ids
    if logits.dim() != 2 or targets.dim() != 1 or fractional:
        what = "[N, classes] logits" if logits.dim() != 2 else "class ids as targets"
        raise TrainingError(
            f"the default validation metrics are for classification and need {what}; got outputs of shape "
            f"{list(logits.shape)} and {targets.dtype} targets of shape {list(targets.shape)}",
            hint="pass metrics_fn(outputs, targets) -> dict (a task: metrics()) for other outputs, e.g. regression",
        )
    logits = logits.detach().float().cpu()
    targets = targets.detach().long().cpu()
    n_classes = logits.shape[1]
    loss = float(F.cross_entropy(logits, targets).item()) if len(targets) else float("nan")
    predicted = logits.argmax(dim=1)
    confusion = torch.zeros(n_classes, n_classes, dtype=torch.long)
    valid = (targets >= 0) & (targets < n_classes)
    confusion.index_put_((targets[valid], predicted[valid]), torch.ones(int(valid.sum()), dtype=torch.long), accumulate=True)
    probabilities = torch.softmax(logits, dim=1).numpy()
    return {
        "loss": loss,
        "accuracy": float((predicted == targets).float().mean().item()) if len(targets) else float("nan"),
        "auc": macro_auc(probabilities, targets.numpy()),
        "samples": int(len(targets)),
        "class_counts": confusion.sum(dim=1).tolist(),
        "predicted_counts": confusion.sum(dim=0).tolist(),
        "confusion": confusion.tolist(),
    }


@dataclass
class BestTracker:
    """Best value of ``metric`` so far and validations since it improved (JSON state)."""

    metric: str
    maximize: bool
    min_delta: float = 0.0
    best: float | None = None
    best_epoch: int | None = None
    best_step: int | None = None
    bad_validations: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    def update(self, metrics: Mapping[str, Any], *, epoch: int, step: int) -> bool:
        """Record one validation; ``True`` when it is the best so far."""
        self.history.append({"epoch": epoch, "step": step, **metrics})
        value = metrics.get(self.metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            self.bad_validations += 1
            return False
        value = float(value)
        improved = self.best is None or (
            value > self.best + self.min_delta if self.maximize else value < self.best - self.min_delta
        )
        if improved:
            self.best, self.best_epoch, self.best_step, self.bad_validations = value, epoch, step, 0
        else:
            self.bad_validations += 1
        return improved

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_step": self.best_step,
                "bad_validations": self.bad_validations, "history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state["best"]
        self.best_epoch = state["best_epoch"]
        self.best_step = state["best_step"]
        self.bad_validations = int(state["bad_validations"])
        self.history = list(state["history"])


#: ``predict_fn(model, batch) -> (outputs, targets)`` for one validation batch.
PredictFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def collect_outputs(model: torch.nn.Module, loader: Any, predict: PredictFn,
                    to_device: Callable[[Any], Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Model outputs and targets over ``loader`` (eval mode; the caller restores train mode)."""
    outputs, targets = [], []
    for batch in loader:
        out, y = predict(model, to_device(batch))
        outputs.append(out.float().cpu())
        targets.append(y.cpu())
    if not outputs:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return torch.cat(outputs), torch.cat(targets)

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

#: ``metrics_fn(outputs, targets) -> {name: value}``; values are floats, ints or lists of them.
MetricsFn = Callable[[Any, Any], dict[str, Any]]


def macro_auc(probabilities: np.ndarray, targets: np.ndarray) -> float | None:
    """Macro one-vs-rest AUC over the classes present in ``targets`` (binary: AUC of class 1)."""
    n_classes = probabilities.shape[1]
    if n_classes == 2:
        return binary_auc(probabilities[:, 1], targets == 1)
    aucs = [a for c in range(n_classes) if (a := binary_auc(probabilities[:, c], targets == c)) is not None]
    return float(np.mean(aucs)) if aucs else None


def primary_output(out: Any) -> torch.Tensor:
    """The logits of a model output: the tensor itself, or the ``logits`` entry of a dict (a Hugging
    Face ``ModelOutput``) or attribute of a named tuple (torchvision's ``InceptionOutputs``)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    keys = f" with keys {sorted(map(str, out))}" if isinstance(out, Mapping) else ""
    raise TrainingError(
        f"the model returned {type(out).__name__}{keys}; the default loss and validation need a logits tensor "
        "(or a dict / named tuple with a 'logits' entry)",
        hint="pass loss_fn(model, batch), predict_fn(model, batch) -> (outputs, targets) and, if needed, "
             "metrics_fn that pick the outputs you want")


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """loss (mean cross-entropy), accuracy, auc (macro OvR), class_counts, predicted_counts, confusion.

    Dense outputs (``[N, C, d1, ...]`` logits with ``[N, d1, ...]`` class ids, e.g. segmentation
    masks) are scored per position (pixel) and get ``mean_iou`` and ``dice`` (macro over the classes
    present) too; ``samples`` stays the number of samples."""
    logits = primary_output(logits)
    fractional = targets.is_floating_point() and not torch.equal(targets, targets.round())  # 0./1. are ids
    dense = (logits.dim() > 2 and targets.dim() == logits.dim() - 1 and not fractional
             and logits.shape[0] == targets.shape[0] and logits.shape[2:] == targets.shape[1:])
    samples = int(targets.shape[0]) if targets.dim() else 0
    if dense:
        logits = logits.movedim(1, -1).reshape(-1, logits.shape[1])
        targets = targets.reshape(-1)
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
    metrics: dict[str, Any] = {
        "loss": loss,
        "accuracy": float((predicted == targets).float().mean().item()) if len(targets) else float("nan"),
        "auc": macro_auc(probabilities, targets.numpy()),
        "samples": samples if dense else int(len(targets)),
        "class_counts": confusion.sum(dim=1).tolist(),
        "predicted_counts": confusion.sum(dim=0).tolist(),
        "confusion": confusion.tolist(),
    }
    if dense:
        tp = confusion.diag().double()
        actual, guessed = confusion.sum(dim=1).double(), confusion.sum(dim=0).double()
        present = actual > 0
        iou = tp / (actual + guessed - tp).clamp(min=1)
        dice = 2 * tp / (actual + guessed).clamp(min=1)
        metrics["mean_iou"] = float(iou[present].mean()) if bool(present.any()) else None
        metrics["dice"] = float(dice[present].mean()) if bool(present.any()) else None
    return metrics


def regression_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """loss (mean squared error), mae, rmse, r2 (over all target values) and samples."""
    out = primary_output(outputs).detach().double().cpu()
    y = targets.detach().double().cpu()
    if out.shape != y.shape and out.numel() == y.numel():
        out = out.reshape(y.shape)  # [N, 1] predictions of [N] targets
    if out.shape != y.shape:
        raise TrainingError(f"regression metrics need outputs shaped like the targets; got {list(out.shape)} "
                            f"and {list(y.shape)}", hint="pass metrics_fn(outputs, targets) -> dict")
    n = int(y.shape[0]) if y.dim() else 1
    if y.numel() == 0:
        return {"loss": float("nan"), "mae": float("nan"), "rmse": float("nan"), "r2": None, "samples": 0}
    err = out - y
    mse = float((err ** 2).mean())
    total = float(((y - y.mean()) ** 2).sum())
    return {"loss": mse, "mae": float(err.abs().mean()), "rmse": math.sqrt(mse),
            "r2": 1.0 - float((err ** 2).sum()) / total if total > 0 else None, "samples": n}


def multilabel_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Independent labels (multi-hot 0/1 targets shaped like the logits): loss (mean binary
    cross-entropy with logits), accuracy (per label at probability 0.5), exact_match (every label of
    a sample right), auc (macro over labels that have both values), label_counts, predicted_counts."""
    z = primary_output(logits).detach().float().cpu()
    y = targets.detach().float().cpu()
    if z.shape != y.shape and z.numel() == y.numel():
        z = z.reshape(y.shape)
    n = int(y.shape[0]) if y.dim() else 1
    if y.numel() == 0:
        return {"loss": float("nan"), "accuracy": float("nan"), "exact_match": float("nan"), "auc": None, "samples": 0}
    y2, z2 = y.reshape(n, -1), z.reshape(n, -1)
    predicted = (z2 > 0).float()
    aucs = [a for j in range(y2.shape[1])
            if (a := binary_auc(torch.sigmoid(z2[:, j]).numpy(), y2[:, j].numpy() > 0.5)) is not None]
    return {
        "loss": float(F.binary_cross_entropy_with_logits(z2, y2)),
        "accuracy": float((predicted == y2).float().mean()),
        "exact_match": float((predicted == y2).all(dim=1).float().mean()),
        "auc": float(np.mean(aucs)) if aucs else None,
        "samples": n,
        "label_counts": y2.sum(dim=0).long().tolist(),
        "predicted_counts": predicted.sum(dim=0).long().tolist(),
    }


def default_metrics(outputs: Any, targets: torch.Tensor) -> dict[str, Any]:
    """The trainer's default ``metrics_fn``: picks the metrics from the shapes and values.

    * class ids (integers, or integral floats) with one dimension less than the outputs:
      :func:`classification_metrics` (``[N, C]``, or per pixel for ``[N, C, H, W]``);
    * float targets shaped like the outputs: rows of probabilities (soft labels) are classification
      against their arg-max; 0/1 values are :func:`multilabel_metrics`; anything else is
      :func:`regression_metrics`, as is one output per sample (``[N]`` or ``[N, 1]``) for any targets
      but 0/1 class ids (binary with one logit: :func:`multilabel_metrics`).
    """
    out = primary_output(outputs)
    if not isinstance(targets, torch.Tensor):
        raise TrainingError(f"the default validation metrics need a tensor of targets, got {type(targets).__name__}",
                            hint="pass metrics_fn(outputs, targets) -> dict")
    if out.dim() == 2 and out.shape[1] > 1 and targets.dim() == 2 and targets.shape[1] == 1:
        targets = targets.squeeze(1)  # class ids (or values) as a column, e.g. df[["label"]].values
    integral = not targets.is_floating_point() or torch.equal(targets, targets.round())
    one_per_sample = out.dim() == 1 or (out.dim() == 2 and out.shape[1] == 1)
    if one_per_sample and targets.numel() == out.shape[0]:
        binary = integral and bool(((targets == 0) | (targets == 1)).all())
        return multilabel_metrics(out, targets) if binary else regression_metrics(out, targets)
    if targets.dim() == out.dim() - 1 and integral:
        return classification_metrics(out, targets)
    if targets.shape == out.shape and targets.is_floating_point():
        if out.dim() == 2 and bool((targets >= 0).all()) and torch.allclose(
                targets.sum(dim=1), torch.ones(targets.shape[0], dtype=targets.dtype), atol=1e-3):
            return classification_metrics(out, targets.argmax(dim=1))
        if bool(((targets == 0) | (targets == 1)).all()):
            return multilabel_metrics(out, targets)
        return regression_metrics(out, targets)
    return classification_metrics(out, targets)  # refuses what it cannot score, with a hint


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Metric values as plain Python, as history, checkpoints and result.json store them: tensors
    (torchmetrics) and NumPy scalars/arrays (scikit-learn) become numbers and lists of them."""
    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            return value.item() if value.dim() == 0 else value.tolist()
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    if not isinstance(metrics, Mapping):
        raise TrainingError(f"metrics_fn returned {type(metrics).__name__}, not a dict of metrics",
                            hint="return {name: value} (numbers or lists of numbers)")
    return {k: plain(v) for k, v in metrics.items()}


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
PredictFn = Callable[[torch.nn.Module, Any], tuple[Any, Any]]


def _host(value: Any, as_float: bool) -> Any:
    """A detached host copy of a tensor (floating outputs as float32), or of each tensor in a
    tuple/list/dict; other values as they are."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return (value.float() if as_float and value.is_floating_point() else value).cpu()
    if isinstance(value, Mapping):
        return {k: _host(v, as_float) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        items = [_host(v, as_float) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _concat(parts: list[Any]) -> Any:
    """Per-batch values joined along the batch: tensors by ``torch.cat`` (0-d ones stacked), tuples,
    lists and dicts element by element (a model's ``(logits, aux)`` or ``{"logits": ...}``)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(parts) if first.dim() == 0 else torch.cat(parts)
    if isinstance(first, Mapping):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        items = [_concat([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return list(parts)


@torch.inference_mode()
def collect_outputs(model: torch.nn.Module, loader: Any, predict: PredictFn,
                    to_device: Callable[[Any], Any]) -> tuple[Any, Any]:
    """Model outputs and targets over ``loader`` (eval mode; the caller restores train mode), joined
    along the batch; outputs and targets may be tensors or tuples/lists/dicts of them."""
    return gather_outputs(model, loader, predict, to_device)


def gather_outputs(model: torch.nn.Module, loader: Any, predict: PredictFn,
                   to_device: Callable[[Any], Any]) -> tuple[Any, Any]:
    """:func:`collect_outputs` in the caller's grad mode (``torch.no_grad()`` before training: a first
    forward under ``inference_mode`` would leave inference tensors in lazily initialised state, e.g.
    FSDP's, which training then cannot update in place)."""
    outputs, targets = [], []
    for batch in loader:
        out, y = predict(model, to_device(batch))
        outputs.append(_host(out, True))
        targets.append(_host(y, False))
    if not outputs:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return _concat(outputs), _concat(targets)

"""The default losses: cross-entropy on class ids (optionally class-weighted) and any loss module
applied to ``(logits, y)``; each refuses targets it would silently mis-train on, naming the loss to
use instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from securetrain.training.batches import call_model, split_batch
from securetrain.training.errors import TrainingError
from securetrain.training.validation import primary_output

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def cross_entropy_loss(model: nn.Module, batch: Any, *, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Default loss: ``F.cross_entropy(model(x), y)`` (``weight``: one per class); see :func:`_cross_entropy`."""
    return _cross_entropy(model, batch, lambda classes: weight)


def _cross_entropy(model: nn.Module, batch: Any,
                   weight_for: Callable[[int], torch.Tensor | None]) -> torch.Tensor:
    """Default loss: ``F.cross_entropy(model(x), y)`` on class ids (also per pixel: ``[N, C, H, W]``
    logits with ``[N, H, W]`` ids) or on probability rows (soft labels); refuses targets that are
    neither (multi-hot labels, regression values) and one logit per sample, naming the loss to use."""
    x, y = split_batch(batch)
    if not isinstance(y, torch.Tensor):
        raise TrainingError(
            f"the targets are a {type(y).__name__} (e.g. label names collated into a list); the default loss needs "
            "class ids (an integer tensor)", hint="map each label to its class id in the dataset, or pass loss_fn")
    out = primary_output(call_model(model, x))
    if out.dim() == 2 and y.dim() == 2 and y.shape[1] == 1 and out.shape[1] > 1:
        y = y.squeeze(1)  # class ids as a column ([N, 1], e.g. df[["label"]].values)
    if out.dim() < 2 or out.shape[1] < 2:
        raise TrainingError(
            f"the model returns outputs of shape {list(out.shape)}; the default loss is cross-entropy, which needs "
            "[N, classes] logits with at least 2 classes (or [N, classes, ...] per position)",
            hint="regression: pass loss_fn (e.g. nn.MSELoss()); one logit per sample for a binary label: "
                 "loss_fn=nn.BCEWithLogitsLoss() with float targets, or return [N, 2] logits")
    if isinstance(y, torch.Tensor) and y.shape == out.shape:
        # Same shape as the logits: only rows of class probabilities (soft labels) are cross-entropy targets.
        probability_rows = y.is_floating_point() and bool(
            (y >= 0).all() & ((y.sum(dim=1) - 1).abs() <= 1e-3).all())
        if not probability_rows:
            raise TrainingError(
                f"the targets have the shape of the outputs ({list(out.shape)}) but are not rows of class "
                "probabilities (multi-hot labels or regression values?); the default loss is cross-entropy",
                hint="multi-label: pass loss_fn=nn.BCEWithLogitsLoss() (float 0/1 targets); regression: "
                     "loss_fn=nn.MSELoss(); the default validation metrics follow the targets")
    if isinstance(y, torch.Tensor) and y.is_floating_point() and y.dim() == out.dim() - 1:
        # Class ids read from a CSV or numpy arrive as floats (1.0); torch wants integers here. Soft
        # targets (one probability per class, y shaped like the logits) go through unchanged.
        if not bool(torch.all(y == torch.round(y))):
            raise TrainingError(
                "the targets hold fractional values; the default loss is cross-entropy on class ids",
                hint="yield integer class ids, or pass loss_fn (e.g. MSE for regression) and metrics_fn",
            )
        y = y.long()
    weight = weight_for(int(out.shape[1]))
    if weight is not None and weight.shape[0] != out.shape[1]:
        raise TrainingError(f"the model returns {out.shape[1]} classes but training.class_weights has "
                            f"{weight.shape[0]} class weights", hint="give one weight per class, in class-id order")
    return F.cross_entropy(out, y, weight=weight)


class WeightedCrossEntropy:
    """The default loss with ``training.class_weights``: given weights, or 'balanced' ones made from
    the training labels' counts once the first logits say how many classes there are."""

    def __init__(self, weights: list[float] | None, counts: torch.Tensor | None) -> None:
        self.weights, self.counts = weights, counts
        self.weight: torch.Tensor | None = None

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return _cross_entropy(model, batch, lambda classes: self._weight(classes, model))

    def _weight(self, classes: int, model: nn.Module) -> torch.Tensor:
        if self.weight is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            if self.weights is not None:
                self.weight = torch.tensor(self.weights, dtype=torch.float32, device=device)
            else:
                assert self.counts is not None
                classes = max(classes, len(self.counts))
                counts = torch.zeros(classes, dtype=torch.float64)
                counts[: len(self.counts)] = self.counts.double()
                total = float(counts.sum())
                # A class absent from the training labels gets weight 1 (it never weighs a sample).
                weight = torch.where(counts > 0, total / (classes * counts.clamp(min=1)), torch.ones_like(counts))
                self.weight = weight.float().to(device)
        return self.weight


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is one scalar tensor (what backward and the logged mean need), else a
    :class:`TrainingError` saying what ``loss_fn`` returned and how to reduce it."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    what = (f"per-sample losses of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor)
            else type(loss).__name__)
    raise TrainingError(f"loss_fn returned {what}; the trainer needs one scalar loss tensor per batch",
                        hint="return loss_fn's mean (e.g. reduction='mean' or .mean()) as a tensor, "
                             "not a Python number (.item() detaches it from the graph)")


#: Losses that take float targets: integer labels are cast to the outputs' dtype for them.
_FLOAT_TARGET_LOSSES = (nn.BCEWithLogitsLoss, nn.BCELoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)


def criterion_loss(criterion: nn.Module) -> LossFn:
    """``loss_fn`` for a loss module: ``criterion(model(x), y)`` (logits picked as by the default
    loss). ``[N, 1]`` outputs meet ``[N]`` targets as ``[N]`` (MSELoss would otherwise broadcast them
    to ``[N, N]`` and train on the wrong loss), and integer targets become floats for BCE/MSE-type losses."""
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = split_batch(batch)
        out = primary_output(call_model(model, x))
        if isinstance(y, torch.Tensor):
            if out.dim() == 2 and out.shape[1] == 1 and y.dim() == 1:
                out = out.squeeze(1)
            if isinstance(criterion, _FLOAT_TARGET_LOSSES) and not y.is_floating_point():
                y = y.to(out.dtype)
        return criterion(out, y)

    loss.__qualname__ = f"criterion_loss({type(criterion).__name__})"
    return loss

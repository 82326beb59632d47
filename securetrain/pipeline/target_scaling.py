"""Regression targets standardised for training; predictions and metrics in the target's own units.

MSE on raw targets in the hundred-thousands (prices) gives losses ~1e10 and a model that starts near
zero, so a few epochs barely move it. With ``data.target_scaling: standard`` (the default) the loss
is computed on ``(y - mean) / std``, mean and std fitted on the training split only; the model's
outputs are therefore standardised values, and every consumer restores them
(``outputs * std + mean``) before scoring: validation metrics (RMSE/MAE in the target's units), the
report, the HE stage, and anyone using the checkpoints' weights (the scaling is saved next to the
checkpoints as ``<run_dir>/train/target-scaling.json`` and in ``result.json``). The released
``model.safetensors`` has the restore built in (:mod:`securetrain.release.target_units`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.errors import PipelineError
from securetrain.training.batches import call_model, split_batch
from securetrain.training.validation import primary_output

TARGET_SCALING_FILE = "target-scaling.json"
FORMAT = "securetrain.pipeline.target-scaling/1"


@dataclass(frozen=True)
class TargetScaling:
    """``standard`` scaling of a regression target: the model learns ``(y - mean) / std``."""

    mean: float
    std: float
    samples: int  # training targets it was fitted on

    def standardise(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets - self.mean) / self.std

    def restore(self, outputs: torch.Tensor) -> torch.Tensor:
        """Model outputs (standardised) -> predictions in the target's units."""
        return outputs * self.std + self.mean

    def to_dict(self) -> dict[str, Any]:
        return {"method": "standard", "mean": self.mean, "std": self.std, "samples": self.samples}


def fit_target_scaling(train: Any) -> TargetScaling:
    """Mean and (population) std of the training split's targets; a constant target keeps std 1
    (centred only), so nothing divides by zero."""
    y = _training_targets(train).detach().double().flatten()
    if y.numel() == 0:
        raise PipelineError("the training split has no targets to standardise", hint="add training samples")
    if not bool(torch.isfinite(y).all()):
        raise PipelineError("the training split holds non-finite regression targets (NaN or infinity)",
                            hint="drop or fix those samples: a regression target must be a finite number")
    mean, std = float(y.mean()), float(y.std(unbiased=False))
    return TargetScaling(mean=mean, std=std if std > 0 and math.isfinite(std) else 1.0, samples=int(y.numel()))


def _training_targets(train: Any) -> torch.Tensor:
    """The targets without loading inputs where the dataset holds them as one tensor (the built-in
    table rows, ``TensorDataset``); otherwise one pass over the dataset."""
    from torch.utils.data import DataLoader, TensorDataset

    labels = getattr(train, "labels", None)
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1 and labels.shape[0] == len(train):
        return labels
    if isinstance(train, TensorDataset) and len(train.tensors) >= 2:
        return train.tensors[1]
    parts = [split_batch(batch)[1] for batch in DataLoader(train, batch_size=256, shuffle=False)]
    return torch.cat([torch.as_tensor(p).flatten() for p in parts]) if parts else torch.empty(0)


class StandardisedMSE:
    """The regression default loss on standardised targets: ``mse(model(x), (y - mean) / std)``
    (``[N, 1]`` outputs meet ``[N]`` targets as ``[N]``, as :func:`criterion_loss` does)."""

    def __init__(self, scaling: TargetScaling) -> None:
        self.scaling = scaling

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = split_batch(batch)
        out = primary_output(call_model(model, x))
        y = torch.as_tensor(y).to(device=out.device, dtype=out.dtype)
        if out.dim() == 2 and out.shape[1] == 1 and y.dim() == 1:
            out = out.squeeze(1)
        return F.mse_loss(out, self.scaling.standardise(y))


class MetricsInTargetUnits:
    """A validation ``metrics_fn`` fed predictions in the target's units (restored outputs)."""

    def __init__(self, metrics_fn: Any, scaling: TargetScaling) -> None:
        self.metrics_fn, self.scaling = metrics_fn, scaling

    def __call__(self, outputs: Any, targets: Any) -> Any:
        return self.metrics_fn(self.scaling.restore(primary_output(outputs)), targets)


def save_target_scaling(run_dir: Path, scaling: TargetScaling | None) -> None:
    """Write (or, for a run without scaling, remove) ``<run_dir>/train/target-scaling.json``."""
    path = Path(run_dir) / "train" / TARGET_SCALING_FILE
    if scaling is None:
        path.unlink(missing_ok=True)  # the file describes the run that trained this folder
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({"format": FORMAT, **scaling.to_dict()}).encode(), mode=0o600)


def load_target_scaling(run_dir: Path) -> TargetScaling | None:
    """The run's target scaling, or ``None`` when its model predicts the target's units directly."""
    path = Path(run_dir) / "train" / TARGET_SCALING_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        scaling = TargetScaling(mean=float(doc["mean"]), std=float(doc["std"]), samples=int(doc["samples"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PipelineError(f"{path.name} is unreadable ({exc})",
                            hint="train the run again: the predictions' units cannot be restored without it") from None
    if not (math.isfinite(scaling.mean) and math.isfinite(scaling.std) and scaling.std > 0):
        raise PipelineError(f"{path.name} holds a non-finite mean or a non-positive std",
                            hint="train the run again")
    return scaling

"""The task protocol every task (built-in or user's) follows, and helpers they share.

A task is an object with:

``prepare(ctx) -> dict`` (optional)
    Runs once per run in the *prepare* stage: read the raw data, protect it (de-identify, mask),
    split it, write what training needs under ``ctx.data_dir``. Returns a small JSON-safe summary
    (counts, digests; never PHI, never key material). Must be idempotent: a rerun overwrites.
``build_datasets(ctx) -> TaskData``
    Called by the train and feature stages: the training and held-out datasets (map-style torch
    Datasets yielding ``(x, y)`` tuples or dicts keyed ``inputs``/``pixels``/``features`` and
    ``label``), the class names in id order, and facts for the model factory
    (``in_channels``/``in_features``). Must be deterministic (same data, same order).
    A regression task returns ``TaskData(train, eval, kind="regression")`` (no class names; float
    targets, one value per sample): the model gets ``num_outputs=1``, the default loss is MSE and
    the default validation metric ``rmse`` (minimised).
``loss(model, batch) -> Tensor`` (optional)
    Default: cross-entropy on ``model(x)``; regression: mean squared error.
``metrics(outputs, targets) -> dict`` (optional)
    Validation metrics from the concatenated model outputs and targets of the held-out split.
    Default: :func:`securetrain.training.validation.default_metrics` (for class ids
    :func:`~securetrain.training.validation.classification_metrics`: loss, accuracy, macro AUC,
    class counts, confusion matrix; regression and multi-label metrics by the targets' shape).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.pipeline.config import PipelineConfig, canonical_label
from securetrain.pipeline.errors import TaskError
from securetrain.pipeline.secrets import RunSecrets


@dataclass
class TaskContext:
    """What a task may use: the config, the run's secrets (never to be logged), the audit recorder."""

    config: PipelineConfig
    secrets: RunSecrets = field(repr=False)
    audit: AuditRecorder = field(default_factory=NullAuditRecorder)

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def data_dir(self) -> Path:
        """Where a task writes its protected, split data (created on first use, owner-only)."""
        path = self.config.run_dir / "data"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path


TASK_KINDS = ("classification", "regression")


@dataclass
class TaskData:
    """What ``build_datasets`` returns. ``kind="regression"``: float targets, one value per sample,
    no ``class_names`` (the model is built with one output)."""

    train: Any
    eval: Any
    class_names: list[str] | None = None  # classification: class id -> name (at least 2)
    model_facts: dict[str, Any] = field(default_factory=dict)  # e.g. in_channels, in_features
    kind: str = "classification"  # or "regression"
    # facts about the inputs for the run's record (result.json training.inputs), e.g. the DICOM colour handling
    inputs: dict[str, Any] = field(default_factory=dict)
    # a digest of the data built (e.g. SHA-256 of the encoded rows): a rerun whose data differ is not
    # resumed from checkpoints trained on the old data (None: not checked)
    data_digest: str | None = None

    @property
    def regression(self) -> bool:
        return self.kind == "regression"

    @property
    def num_classes(self) -> int:
        return len(self.class_names or [])

    @property
    def num_outputs(self) -> int:
        """The model's output width: one value per sample (regression), else one logit per class."""
        return 1 if self.regression else self.num_classes


@runtime_checkable
class Task(Protocol):
    def build_datasets(self, ctx: TaskContext) -> TaskData: ...


def label_names(values: Iterable[str], classes: list[str] | None, *, where: str) -> list[str]:
    """Class names in id order: ``classes`` if given (every label must be one), else sorted distinct
    labels (numerically when all are integers, so ``2`` < ``10``)."""
    distinct = sorted(set(values))
    if classes is not None:
        classes = [canonical_label(c) for c in classes]  # as the labels are ("01" is "1")
        repeated = sorted({c for c in classes if classes.count(c) > 1})
        if repeated:
            raise TaskError(f"{where}: data.classes names {', '.join(map(repr, repeated))} more than once",
                            hint="list every class once (integer labels: 01 is 1)")
        unknown = [v for v in distinct if v not in classes]
        if unknown:
            raise TaskError(f"{where}: {len(unknown)} label value(s) not in data.classes",
                            hint="add them to data.classes or fix the labels")
        return list(classes)
    fractional = [v for v in distinct if _is_number(v) and not float(v).is_integer()]
    if fractional and all(_is_int(v) or _is_number(v) for v in distinct):
        # A regression target (a price, a loss, a score) would otherwise train one class per value.
        raise TaskError(
            f"{where}: the label column holds non-integer numbers ({len(distinct)} distinct values, "
            f"{len(fractional)} with a fraction): this task trains a classifier on class labels",
            hint="the pipeline trains classifiers only: bin a regression target into classes in your "
            "data (e.g. low/mid/high), or list these values in data.classes to use them as class names",
        )
    try:
        return [str(v) for v in sorted({int(v) for v in distinct})] if all(_is_int(v) for v in distinct) else distinct
    except ValueError:  # pragma: no cover - guarded by _is_int
        return distinct


def _is_number(value: str) -> bool:
    import math

    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def holdout(entities: Iterable[str], fraction: float) -> set[str]:
    """Entities held out for evaluation: a fixed share, chosen by a hash order of their pseudonyms."""
    ordered = sorted(set(entities), key=lambda e: hashlib.sha256(e.encode()).hexdigest())
    n_eval = max(1, round(len(ordered) * fraction)) if len(ordered) > 1 else 0
    return set(ordered[:n_eval])


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolve_task(config: PipelineConfig) -> Any:
    """The task object for ``config.task`` (built-in by kind, or the user's factory called with kwargs)."""
    kind = config.task.kind
    if kind == "dicom-classification":
        from securetrain.pipeline.tasks.dicom import DicomClassification

        return DicomClassification(**config.task.kwargs)
    if kind == "tabular-classification":
        from securetrain.pipeline.tasks.tabular import TabularClassification

        return TabularClassification(**config.task.kwargs)
    if kind == "tabular-regression":
        from securetrain.pipeline.tasks.tabular import TabularRegression

        return TabularRegression(**config.task.kwargs)
    from securetrain.pipeline.models import import_target

    assert config.task.target is not None
    factory = import_target(config.task.target, base_dir=config.base_dir, what="task.target", error=TaskError)
    if not callable(factory):
        raise TaskError(f"task.target {config.task.target!r} is not callable", hint="name a class or function returning the task")
    try:
        task = factory(**config.task.kwargs)
    except TypeError as exc:
        raise TaskError(f"task.target {config.task.target!r} rejected task.kwargs: {exc}") from None
    if not callable(getattr(task, "build_datasets", None)):
        raise TaskError(f"task.target {config.task.target!r} returned {type(task).__name__}, which has no build_datasets(ctx)",
                        hint="see docs/tasks.md for the task protocol")
    return task

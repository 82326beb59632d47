"""Models for the pipeline: built-ins by name, entry points, or any ``"module:callable"``.

``model.target`` resolves, in order:

1. a built-in name: ``cnn`` (:class:`SmallCNN`, the demo's), ``mlp`` (:class:`TabularMLP`),
   ``logistic`` (:class:`LogisticRegression`);
2. a name registered by an installed package under the entry-point group ``securetrain.models``;
3. ``"package.module:callable"``, imported with the config file's folder first on ``sys.path``,
   then ``PYTHONPATH``.

The callable is called with ``model.kwargs``, plus what the task knows and the callable accepts
but the kwargs do not set: ``num_classes``, ``in_channels`` (images), ``in_features`` (tables);
for a regression task ``num_outputs=1`` and ``num_classes=1``.
It must return an ``nn.Module`` whose output on a batch is ``[batch, num_classes]`` logits
(regression: ``[batch, 1]``); that is checked on one real batch before training
(:func:`check_model_output`).

HE evaluation needs a linear head: by default the model's last ``nn.Linear`` (in module order)
is the head and its input the features, which the data owner computes in plaintext
(:func:`head_and_features`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from torch import nn

from securetrain.errors import SecureTrainError
from securetrain.pipeline.errors import ModelOutputError, ModelTargetError, TaskError
from securetrain.training.errors import TrainingError
from securetrain.training.state import buffers_kept
from securetrain.training.validation import primary_output

ENTRY_POINT_GROUP = "securetrain.models"


class SmallCNN(nn.Module):
    """Two conv blocks, global max pooling, one hidden layer, a linear head (the demo's model)."""

    def __init__(self, channels: int = 8, hidden: int = 16, num_classes: int = 2, in_channels: int = 1) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(1),  # "is there a bright blob anywhere": position-invariant
            nn.Flatten(),
            nn.Linear(2 * channels, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class TabularMLP(nn.Module):
    """Feed-forward classifier for encoded table rows: ``hidden`` sizes with ReLU, a linear head."""

    def __init__(self, in_features: int, num_classes: int = 2, hidden: Sequence[int] = (32,), dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, int(size)), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = int(size)
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one linear layer (exactly evaluable under CKKS)."""

    def __init__(self, in_features: int, num_classes: int = 2) -> None:
        super().__init__()
        self.head = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))


BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": SmallCNN,
    "mlp": TabularMLP,
    "logistic": LogisticRegression,
}


@contextmanager
def importable_from(folder: Path | None):
    """Put ``folder`` first on ``sys.path`` for the duration (user code next to the config wins)."""
    entry = str(folder) if folder is not None else ""
    added = bool(entry) and entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added:
            try:
                sys.path.remove(entry)
            except ValueError:
                pass


def import_target(target: str, *, base_dir: Path | None, what: str = "model.target",
                  error: type[SecureTrainError] = ModelTargetError) -> Any:
    """The object named ``"package.module:attr.path"`` (config folder first on the import path)."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise error(f"{what} {target!r} is not 'package.module:callable'",
                    hint="e.g. mymodels.nets:build, a built-in name, or an installed entry point")
    with importable_from(base_dir):
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise error(f"{what} {target!r} does not import: {type(exc).__name__}: {exc}",
                        hint="put the module next to the config file or on PYTHONPATH") from None
        except Exception as exc:  # a user module raising at import time
            raise error(f"{what} {target!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{what} {target!r} does not import: {module_name} has no attribute {attr_path!r}",
                        hint="check the name after ':'") from None
    return obj


def entry_point_models() -> dict[str, Any]:
    """Models third-party packages register under the ``securetrain.models`` entry-point group."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def resolve_model_factory(target: str, *, base_dir: Path | None = None) -> Callable[..., Any]:
    """The callable ``target`` names (built-in, entry point, or ``module:callable``)."""
    if target in BUILTIN_MODELS:
        return BUILTIN_MODELS[target]
    if ":" not in target:
        eps = entry_point_models()
        if target not in eps:
            known = ", ".join(sorted([*BUILTIN_MODELS, *eps]))
            raise ModelTargetError(f"model.target {target!r} is neither a built-in model nor a registered entry point",
                                   hint=f"use one of {known}, or 'package.module:callable'")
        try:
            factory = eps[target].load()
        except Exception as exc:
            raise ModelTargetError(f"model.target {target!r}: entry point does not import: {type(exc).__name__}: {exc}") from None
    else:
        factory = import_target(target, base_dir=base_dir)
    if not callable(factory):
        raise ModelTargetError(f"model.target {target!r} is not callable (it is a {type(factory).__name__})",
                               hint="name a function or class that returns an nn.Module")
    return factory


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def build_model(target: str, kwargs: dict[str, Any], *, base_dir: Path | None = None, seed: int = 0,
                **task_facts: Any) -> nn.Module:
    """Call the model factory with ``kwargs`` (+ the task facts it accepts) under a fixed seed."""
    factory = resolve_model_factory(target, base_dir=base_dir)
    call_kwargs = dict(kwargs)
    for name, value in task_facts.items():
        if value is not None and name not in call_kwargs and _accepts(factory, name):
            call_kwargs[name] = value
    torch.manual_seed(seed)  # the same initial weights on every (re)build of this run's model
    try:
        with importable_from(base_dir):
            model = factory(**call_kwargs)
    except TypeError as exc:
        raise ModelTargetError(f"model.target {target!r} rejected its arguments: {exc}",
                               hint="check model.kwargs against the callable's signature") from None
    except Exception as exc:  # the user's factory refusing its settings (ValueError, AssertionError, ...)
        raise ModelTargetError(f"model.target {target!r} failed: {type(exc).__name__}: {exc}",
                               hint="check model.kwargs and the task facts it was given "
                                    f"({', '.join(sorted(call_kwargs)) or 'none'})") from None
    if not isinstance(model, nn.Module):
        raise ModelTargetError(f"model.target {target!r} returned {type(model).__name__}, not a torch.nn.Module",
                               hint="the callable must return the model instance")
    return model


def _plain_predict(model: nn.Module, inputs: Any) -> tuple[Any, None]:
    return model(inputs), None


def check_model_output(model: nn.Module, inputs: Any, num_classes: int, *, target: str,
                       predict: Callable[[nn.Module, Any], tuple[Any, Any]] | None = None,
                       regression: bool = False) -> None:
    """One forward pass on a real batch: the output must be ``[batch, num_classes]`` logits
    (``regression``: ``[batch, 1]`` or ``[batch]``, one value per sample).

    ``inputs`` is the model's input tensor, or (with ``predict(model, batch) -> (outputs, targets)``,
    a task's own validation step) a whole batch.
    """
    step = predict or _plain_predict
    was_training = model.training
    model.eval()
    try:
        # A look: a forward that updates buffers (in eval mode too) must not train on this batch.
        with torch.no_grad(), buffers_kept(model):
            out, targets = step(model, inputs)
    except Exception as exc:
        shape = tuple(inputs.shape) if hasattr(inputs, "shape") else type(inputs).__name__
        raise ModelOutputError(f"model {target!r} failed on a batch of shape {shape}: {type(exc).__name__}: {exc}",
                               hint="check the model's expected input shape (channels, size, features)") from None
    finally:
        model.train(was_training)
    _refuse_untensored(out, target=target, regression=regression)
    if regression:
        _check_regression_output(out, targets, inputs, target=target)
        return
    if targets is not None and not isinstance(targets, torch.Tensor):  # e.g. strings collated into a list
        raise TaskError(f"the task's batches carry labels as a {type(targets).__name__}; they must be class ids (integers "
                        f"indexing class_names, 0..{num_classes - 1})",
                        hint="map each label to its index in TaskData.class_names in the dataset")
    source = inputs if targets is None else targets
    batch = source.shape[0] if hasattr(source, "shape") else None
    with suppress(TrainingError):  # a dict / named tuple with 'logits', as the Trainer reads it
        out = primary_output(out)
    # [N, C] logits, or per position [N, C, d1, ...] for [N, d1, ...] targets (segmentation masks).
    dense = (isinstance(out, torch.Tensor) and isinstance(targets, torch.Tensor) and out.dim() > 2
             and targets.dim() == out.dim() - 1 and tuple(targets.shape[1:]) == tuple(out.shape[2:]))
    if (not isinstance(out, torch.Tensor) or (out.dim() != 2 and not dense) or out.shape[0] != batch
            or out.shape[1] != num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelOutputError(
            f"model {target!r} returns {shape} for a batch of {batch}; the task has {num_classes} classes, "
            f"so it must return [{batch}, {num_classes}] logits",
            hint="set the head's output size (built-ins and callables taking num_classes get it automatically)",
        )


def _refuse_untensored(out: Any, *, target: str, regression: bool) -> None:
    """An output the pipeline cannot read the predictions from (a plain tuple, a dict without
    ``logits``) is refused with what to return, not as a wrong output size."""
    with suppress(TrainingError):
        primary_output(out)
        return
    keys = f" with keys {sorted(map(str, out))}" if isinstance(out, Mapping) else ""
    want = "[batch, 1] predictions" if regression else "[batch, classes] logits"
    raise ModelOutputError(
        f"model {target!r} returns a {type(out).__name__}{keys}, not a tensor of {want} nor a dict / named "
        "tuple with a 'logits' entry",
        hint="return the tensor, or {'logits': tensor, ...} / a named tuple with a 'logits' field; a custom task "
             "can instead define loss(model, batch) and predict(model, batch) that pick the outputs it uses",
    )


def _check_regression_output(out: Any, targets: Any, inputs: Any, *, target: str) -> None:
    """A regression model returns one value per sample; the targets are floats, one per sample."""
    if targets is not None and not (isinstance(targets, torch.Tensor) and targets.is_floating_point()):
        what = f"{targets.dtype} tensor" if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TaskError(f"the regression task's batches carry targets as a {what}; they must be float values",
                        hint="yield one float target per sample (e.g. torch.float32)")
    source = inputs if targets is None else targets
    batch = source.shape[0] if hasattr(source, "shape") else None
    with suppress(TrainingError):
        out = primary_output(out)
    if (not isinstance(out, torch.Tensor) or out.shape[0] != batch or out.dim() > 2
            or (out.dim() == 2 and out.shape[1] != 1)):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelOutputError(
            f"model {target!r} returns {shape} for a batch of {batch}; the task is a regression, so it must "
            f"return [{batch}, 1] (one value per sample)",
            hint="size the output layer with num_outputs (built-ins and callables taking num_outputs or "
                 "num_classes get 1 automatically)",
        )
    if isinstance(targets, torch.Tensor) and targets.numel() != batch:
        raise TaskError(f"the regression task's targets hold {targets.numel()} values for a batch of {batch}; "
                        "the pipeline trains one target per sample", hint="yield one float per sample")


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def last_linear(model: nn.Module) -> tuple[str, nn.Linear]:
    """The model's last ``nn.Linear`` in module order (its classification head by convention)."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ModelOutputError("the model has no nn.Linear layer to serve as the HE-evaluated head",
                               hint="end the model in a linear layer, or set he.enabled: false")
    return found[-1]


@torch.inference_mode()
def head_and_features(model: nn.Module, batches: Any, predict: Callable[[nn.Module, Any], tuple[Any, Any]]
                      ) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """The head, its input features over ``batches`` (via a forward pre-hook) and the labels;
    ``predict(model, batch) -> (outputs, targets)`` runs one batch."""
    _, head = last_linear(model)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().flatten(1).float()))
    labels: list[torch.Tensor] = []
    try:
        model.eval()
        for batch in batches:
            _, y = predict(model, batch)
            labels.append(y)
    finally:
        hook.remove()
    return head, torch.cat(captured), torch.cat(labels)


def linear_bias(layer: nn.Linear) -> torch.Tensor:
    """The layer's bias, or zeros for a layer built with ``bias=False`` (a head HE scores all the same)."""
    if layer.bias is None:
        return torch.zeros(layer.out_features, dtype=layer.weight.dtype, device=layer.weight.device)
    return layer.bias.detach()


def he_head(weight: torch.Tensor, bias: torch.Tensor) -> nn.Sequential:
    """The head for HE: 2 classes -> one logistic unit (logit of class 1 minus class 0), else as is."""
    if weight.shape[0] == 2:
        weight = (weight[1] - weight[0]).unsqueeze(0)
        bias = (bias[1] - bias[0]).unsqueeze(0)
    linear = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return nn.Sequential(linear)


def logistic_head(model: nn.Module) -> nn.Sequential:
    """The 2-class head as one logistic unit (kept for callers of the earlier API)."""
    _, head = last_linear(model)
    if head.out_features != 2:
        raise ValueError("the HE head export needs a 2-class model")
    return he_head(head.weight.detach(), linear_bias(head))

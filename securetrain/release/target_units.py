"""The released regression model predicts in the target's units, not standardised values.

A regression run trained on standardised targets (:mod:`securetrain.pipeline.target_scaling`) has
weights whose outputs are ``(y - mean) / std``; its checkpoints keep them so (resume, validation and
the HE stage restore them). The released ``model.safetensors`` is what users load into the model
and run, so there the restore ``output * std + mean`` is part of the weights:

- **folded** (preferred): when the model's output *is* one ``nn.Linear``'s output (reshapes and
  eval-mode no-ops after it are fine), that layer's ``weight`` becomes ``weight * std`` and its
  ``bias`` ``bias * std + mean`` (every output row alike: single and multi-output regression). The
  file has the model's own names and shapes: ``model.load_state_dict(load_file(path))`` as before.
- **wrapped** (otherwise: no such layer, a layer without bias, a layer used more than once or tied
  to another): the model's tensors under ``model.<name>``, plus the float64 scalars ``target_mean``
  and ``target_std``, exactly the state of :class:`TargetUnits` around the model; loading it into
  the bare model fails loudly (unexpected keys) instead of predicting off by the scale.
- **none**: a model whose output is not a tensor (a dict, say) is released as trained, and the
  record says ``units: standardised`` with the restore to apply (a warning is logged).

:func:`released_outputs` decides on the trained model and a sample batch (either form is checked:
the released weights, loaded as a user would, must predict ``model(x) * std + mean`` on it) and
returns the record the signed provenance carries (``predicate.model.releasedOutputs``);
:func:`released_tensors` applies a record to the checkpoint's tensors with tensor arithmetic only,
so the release gate re-derives the same bytes from the statement without building the model.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from securetrain.release.errors import ProvenanceError

log = logging.getLogger("securetrain.release.target_units")

#: ``predicate.model.releasedOutputs.format``.
FORMAT = "securetrain.release.target-units/1"
MEAN_KEY, STD_KEY = "target_mean", "target_std"
_WRAPPED_PREFIX = "model."


class TargetUnits(nn.Module):
    """``model`` with its outputs restored to the target's units: ``model(*args) * std + mean``
    (computed in float64, returned in the output's dtype). Its state (``model.<name>`` and the
    ``target_mean``/``target_std`` buffers) is a *wrapped* release's tensors."""

    def __init__(self, model: nn.Module, mean: float = 0.0, std: float = 1.0) -> None:
        super().__init__()
        self.model = model
        self.register_buffer(MEAN_KEY, torch.tensor(float(mean), dtype=torch.float64))
        self.register_buffer(STD_KEY, torch.tensor(float(std), dtype=torch.float64))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"TargetUnits restores a tensor output, and the model returned {type(out).__name__}")
        mean, std = self.get_buffer(MEAN_KEY), self.get_buffer(STD_KEY)
        return (out.double() * std + mean).to(out.dtype)


def _output_layer(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> str | None:
    """The path of the ``nn.Linear`` whose output the model returns (up to a reshape), or None."""
    outputs: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}

    def watch(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
            if isinstance(out, torch.Tensor):
                outputs[name] = out.detach()
        return hook

    handles = [m.register_forward_hook(watch(name)) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        y = run(model)
    finally:
        for h in handles:
            h.remove()
    found = [name for name, out in outputs.items()
             if out.numel() == y.numel() and torch.equal(out.reshape(y.shape), y)]
    if not found or calls[found[-1]] != 1:
        return None  # a layer called twice would be scaled in both places
    return found[-1]


def _fold_record(layer: str, mean: float, std: float) -> dict[str, Any]:
    return {"format": FORMAT, "units": "target", "method": "folded", "layer": layer, "mean": mean, "std": std,
            "weight": f"{layer}.weight * std", "bias": f"{layer}.bias * std + mean"}


def _wrap_record(mean: float, std: float) -> dict[str, Any]:
    return {"format": FORMAT, "units": "target", "method": "wrapped", "mean": mean, "std": std,
            "module": "securetrain.release.target_units.TargetUnits",
            "tensors": f"{_WRAPPED_PREFIX}<name>: the model's; {MEAN_KEY}, {STD_KEY}: float64 scalars"}


def released_outputs(model: nn.Module, state: Mapping[str, torch.Tensor], scaling: Mapping[str, Any],
                     run: Callable[[nn.Module], torch.Tensor]) -> dict[str, Any]:
    """The record of how the released weights give the target's units, for ``model`` (trained, in
    eval mode) with checkpoint tensors ``state`` (its state dict's names), ``scaling`` (``{mean,
    std}``) and ``run(model) -> outputs`` on a sample batch: folded into the output layer when that
    predicts exactly the restored outputs, else wrapped, else (neither predicts them) none."""
    mean, std = float(scaling["mean"]), float(scaling["std"])
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ProvenanceError(f"the target scaling has a non-finite mean or a non-positive std ({mean}, {std})")
    with torch.no_grad():
        expected = run(model).double() * std + mean
        tolerance = 1e-4 * std + 1e-6 * abs(mean)

        def loads_and_predicts(module: nn.Module, record: dict[str, Any]) -> bool:
            """``record``'s tensors load into ``module`` as a user loads them (strict, its own names)
            and it predicts the restored outputs."""
            try:
                module.load_state_dict(released_tensors(state, record), strict=True)
                out = run(module)
            except (RuntimeError, TypeError, ProvenanceError):
                return False
            return out.shape == expected.shape and bool(((out.double() - expected).abs() <= tolerance).all())

        layer = _output_layer(model, run)
        if layer is not None and f"{layer}.bias" in state:
            record = _fold_record(layer, mean, std)
            if loads_and_predicts(copy.deepcopy(model), record):
                return record
            log.info("the output layer %s cannot take the target scaling alone (tied or reused weights); the "
                     "released weights are wrapped (TargetUnits)", layer)
        record = _wrap_record(mean, std)
        fits = loads_and_predicts(TargetUnits(copy.deepcopy(model)), record)
    if fits:
        return record
    # Not a tensor (a dict of outputs, say): released as trained, and the statement says so.
    log.warning("the released regression model outputs standardised values (prediction = output * %.6g + %.6g): "
                "its output is neither an nn.Linear layer's nor a tensor TargetUnits can restore", std, mean)
    return {"format": FORMAT, "units": "standardised", "method": "none", "mean": mean, "std": std,
            "restore": "prediction = output * std + mean"}


def released_tensors(state: Mapping[str, torch.Tensor], record: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """The released model's tensors: ``state`` (the checkpoint's model tensors, by name) as is
    (``record`` None: a model that predicts the target's units itself), folded or wrapped as the
    record says. Float64 arithmetic, cast back to each tensor's dtype: the same bytes every time."""
    tensors = dict(state)
    if record is None or (record.get("format") == FORMAT and record.get("method") == "none"):
        return tensors
    if record.get("format") != FORMAT or record.get("units") != "target":
        raise ProvenanceError(f"releasedOutputs is not a {FORMAT} record")
    mean, std = float(record["mean"]), float(record["std"])
    if record.get("method") == "folded":
        layer = str(record["layer"])
        weight, bias = tensors.get(f"{layer}.weight"), tensors.get(f"{layer}.bias")
        if weight is None or bias is None:
            raise ProvenanceError(f"releasedOutputs folds into {layer!r}, which has no weight and bias in the checkpoint")
        tensors[f"{layer}.weight"] = (weight.double() * std).to(weight.dtype)
        tensors[f"{layer}.bias"] = (bias.double() * std + mean).to(bias.dtype)
        return tensors
    if record.get("method") == "wrapped":
        out = {f"{_WRAPPED_PREFIX}{name}": t for name, t in tensors.items()}
        out[MEAN_KEY] = torch.tensor(mean, dtype=torch.float64)
        out[STD_KEY] = torch.tensor(std, dtype=torch.float64)
        return out
    raise ProvenanceError(f"releasedOutputs method {record.get('method')!r} is neither 'folded' nor 'wrapped'")

"""Released regression weights predict in the target's units: the restore ``output * std + mean``
folded into the output Linear (single and multi-output), or wrapped (TargetUnits) where folding
would be wrong, or recorded as not done; the same bytes from the record alone (the gate's way)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from securetrain.release.errors import ProvenanceError
from securetrain.release.provenance import model_safetensors
from securetrain.release.target_units import TargetUnits, released_outputs, released_tensors

SCALING = {"mean": 3.0e5, "std": 1.2e5}
X = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))


def _run(model: nn.Module) -> torch.Tensor:
    return model(X)


def _checkpoint(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: ``model/<name>`` tensors."""
    return {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}


def _release(model: nn.Module, tmp: Path) -> tuple[dict, Path]:
    """The record, and the released file as the provenance writes it (from the checkpoint's tensors)."""
    model.eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    record = released_outputs(model, state, SCALING, _run)
    path = tmp / "model.safetensors"
    path.write_bytes(model_safetensors(_checkpoint(model), record))
    return record, path


def _expected(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(X).double() * SCALING["std"] + SCALING["mean"]


class Squeezed(nn.Module):
    """A custom forward: the head's output squeezed to [N] (a reshape after the layer folds fine)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.ReLU())
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x)).squeeze(1)


@pytest.mark.parametrize(("build", "layer"), [
    (lambda: nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1)), "2"),
    (lambda: nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3), nn.Dropout(0.2)), "2"),  # multi-output
    (Squeezed, "out"),
])
def test_folded_into_the_output_layer(tmp_path: Path, build, layer: str) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = build()
    record, path = _release(model, tmp_path)
    assert record["method"] == "folded" and record["units"] == "target" and record["layer"] == layer
    assert record["mean"] == SCALING["mean"] and record["std"] == SCALING["std"]
    user = build()
    user.load_state_dict(load_file(path), strict=True)  # the model's own names: as a user loads it
    with torch.no_grad():
        got = user.eval()(X).double()
    assert torch.allclose(got, _expected(model), rtol=1e-6, atol=1e-3 * SCALING["std"])
    assert abs(float(got.mean()) - SCALING["mean"]) < 3 * SCALING["std"]  # prices, not z-scores
    # Every other tensor is released as trained.
    released = load_file(path)
    for name, value in model.state_dict().items():
        if not name.startswith(f"{layer}."):
            assert torch.equal(released[name], value), name
    # The gate's way: the same bytes from the record and the checkpoint alone, every time.
    assert model_safetensors(_checkpoint(model), record) == path.read_bytes()


class Tied(nn.Module):
    """The output layer is used twice: scaling its weights would change the first use too."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.square(torch.relu(self.square(x)))


class SharedWeight(nn.Module):
    """The output layer's weight is another layer's too (two modules, one Parameter): found as the
    output layer, but the fold, loaded as a user loads it, scales both; checked and wrapped instead."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.out = nn.Linear(5, 5), nn.Linear(5, 5)
        self.out.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.first(x)))


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1, bias=False)),  # no bias to shift
    lambda: nn.Sequential(nn.Linear(5, 1), nn.Tanh()),  # not affine after the last Linear
    Tied,
    SharedWeight,
])
def test_wrapped_where_folding_would_be_wrong(tmp_path: Path, build) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = build()
    record, path = _release(model, tmp_path)
    assert record["method"] == "wrapped" and record["units"] == "target"
    with pytest.raises(RuntimeError, match="Unexpected key"):  # never silently off by the scale
        build().load_state_dict(load_file(path), strict=True)
    user = TargetUnits(build())
    user.load_state_dict(load_file(path), strict=True)
    with torch.no_grad():
        got = user.eval()(X).double()
    assert torch.allclose(got, _expected(model), rtol=1e-6, atol=1e-3 * SCALING["std"])


def test_an_output_that_is_not_a_tensor_is_released_as_trained_and_recorded_so(tmp_path: Path) -> None:
    class Dict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(5, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": torch.sigmoid(self.head(x))}

    model = Dict()
    record = released_outputs(model, dict(model.state_dict()), SCALING, lambda m: m(X)["logits"])
    assert record["units"] == "standardised" and record["method"] == "none"
    assert record["restore"] == "prediction = output * std + mean"
    assert model_safetensors(_checkpoint(model), record) == model_safetensors(_checkpoint(model))


def test_a_bad_record_is_refused() -> None:
    state = {"0.weight": torch.ones(1, 2)}
    with pytest.raises(ProvenanceError, match="no weight and bias"):
        released_tensors(state, {"format": "securetrain.release.target-units/1", "units": "target",
                                 "method": "folded", "layer": "0", "mean": 0.0, "std": 1.0})
    with pytest.raises(ProvenanceError, match="record"):
        released_tensors(state, {"format": "other", "units": "target", "method": "folded"})
    with pytest.raises(ProvenanceError, match="neither"):
        released_tensors(state, {"format": "securetrain.release.target-units/1", "units": "target",
                                 "method": "scaled", "mean": 0.0, "std": 1.0})
    assert released_tensors(state, None).keys() == state.keys()

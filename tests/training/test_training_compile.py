"""A ``torch.compile``'d model (``OptimizedModule``) through the Trainer: checkpoints hold the
underlying module's names (no ``_orig_mod.``), so the weights load into the plain model; a compiled
run resumes exactly (also from a checkpoint written with the wrapper's names, as before); a
``forward`` with several inputs still gets them spread. ``backend="eager"`` keeps it fast on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from two_inputs import TwoInputs

from securetrain.training import SafetensorsCheckpointStore, Trainer, TrainingConfig
from securetrain.training.state import load_model_state
from securetrain.training.trainer import TRAIN_FORMAT_KEY

torch.set_num_threads(1)

G = torch.Generator().manual_seed(0)
X = torch.randn(48, 6, generator=G)
Y = torch.randint(0, 3, (48,), generator=G)
DATA = TensorDataset(X, Y)


def _compile(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


@pytest.fixture(scope="module", autouse=True)
def _compile_available() -> None:
    try:
        _compile(nn.Linear(2, 2))(torch.zeros(1, 2))
    except Exception as exc:  # noqa: BLE001 - any failure: this torch build cannot compile here
        pytest.skip(f"torch.compile(backend='eager') does not work on this torch build: {type(exc).__name__}: {exc}")


def _net(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _cfg(tmp: Path, **kw: Any) -> TrainingConfig:
    base: dict[str, Any] = dict(epochs=2, batch_size=8, seed=3, output_dir=tmp, device="cpu", log_every=1,
                                lr=1e-2, checkpoint_every=2)
    return TrainingConfig(**(base | kw))


def _model_state(tmp: Path) -> dict[str, torch.Tensor]:
    ckpt = SafetensorsCheckpointStore(tmp / "checkpoints").load()
    return {k.removeprefix("model/"): v for k, v in ckpt.tensors.items() if k.startswith("model/")}


def test_checkpoint_of_a_compiled_model_loads_into_the_plain_model(tmp_path: Path) -> None:
    """Before: the checkpoint held model/_orig_mod.0.weight, ..., which the plain model refuses."""
    plain = _net()
    r = Trainer(_compile(plain), DATA, _cfg(tmp_path)).fit()
    assert r.steps == 12
    saved = _model_state(tmp_path)
    assert not any("_orig_mod" in k for k in saved), sorted(saved)
    fresh = _net(seed=9)
    fresh.load_state_dict(saved, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    # Either form into a model with or without the wrapper (what the pipeline's model loading uses).
    load_model_state(_compile(_net(seed=5)), saved)
    load_model_state(_net(seed=5), {f"_orig_mod.{k}": v for k, v in saved.items()})


def test_compiled_model_resumes_exactly_and_accepts_either_form(tmp_path: Path) -> None:
    """A compiled run stopped at step 5 and resumed by a fresh compiled model ends bit-identical to an
    uninterrupted (plain) run; a checkpoint written with the wrapper's names (before this fix) and one
    written by a plain run both resume a compiled model, and the other way round."""
    ref = _net()
    Trainer(ref, DATA, _cfg(tmp_path / "ref")).fit()

    Trainer(_compile(_net()), DATA, _cfg(tmp_path / "run", max_steps=5)).fit()
    stopped = SafetensorsCheckpointStore(tmp_path / "run" / "checkpoints").load()
    assert stopped.info.step == 5 and stopped.metadata[TRAIN_FORMAT_KEY]
    resumed = _net(seed=7)
    r = Trainer(_compile(resumed), DATA, _cfg(tmp_path / "run")).fit()
    assert r.resumed_from == 5 and r.steps == 12
    for k, v in ref.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k

    # The old form: the step-5 checkpoint with model/_orig_mod.* names resumes a plain and a compiled model.
    tensors = {(f"model/_orig_mod.{k.removeprefix('model/')}" if k.startswith("model/") else k): v
               for k, v in stopped.tensors.items()}
    for name, wrap in (("old-plain", False), ("old-compiled", True)):
        SafetensorsCheckpointStore(tmp_path / name / "checkpoints").save(5, tensors, dict(stopped.metadata))
        model = _net(seed=11)
        r = Trainer(_compile(model) if wrap else model, DATA, _cfg(tmp_path / name)).fit()
        assert r.resumed_from == 5 and r.steps == 12, name
        for k, v in ref.state_dict().items():
            assert torch.equal(v, model.state_dict()[k]), (name, k)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _compile(nn.Linear(6, 3))  # a compiled submodule: state names enc.body._orig_mod.*

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_compiled_submodule_is_saved_under_plain_names(tmp_path: Path) -> None:
    model = nn.Sequential(_Encoder())
    Trainer(model, DATA, _cfg(tmp_path, epochs=1)).fit()
    saved = _model_state(tmp_path)
    assert sorted(saved) == ["0.body.bias", "0.body.weight"]
    resumed = nn.Sequential(_Encoder())
    r = Trainer(resumed, DATA, _cfg(tmp_path, epochs=2)).fit()
    assert r.resumed_from == 6 and r.steps == 12


class PairData(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> Any:
        return (X[i], X[i, :2]), Y[i]


def test_compiled_model_with_two_inputs_gets_them_spread(tmp_path: Path) -> None:
    """The wrapper's forward is (*args, **kwargs): the inputs were passed as one tuple."""
    r = Trainer(_compile(TwoInputs()), PairData(), _cfg(tmp_path, epochs=1), eval_data=PairData()).fit()
    assert r.reason == "completed" and r.validation[-1]["samples"] == 48

"""Optimizer state of any shape checkpoints without pickle (safetensors tensors + JSON) and round-trips
exactly: LBFGS (lists of tensors, floats, ints), a tensor learning rate, AMSGrad, momentum, Adagrad;
values a checkpoint cannot hold are refused with a typed error naming where they are."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from securetrain.training import (
    SafetensorsCheckpointStore,
    StepMetrics,
    Trainer,
    TrainerCallback,
    TrainingConfig,
    UncheckpointableStateError,
)
from securetrain.training import state as st
from securetrain.training.errors import CheckpointCorruptError
from securetrain.training.synthetic import SyntheticClassification, make_mlp

torch.set_num_threads(1)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.5, history_size=3, max_iter=4),
    "adam_tensor_lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2)),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x, y = _batch()
    for _ in range(steps):
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)


def _same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _same(u, v, f"{where}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where


def _through_safetensors(state: dict[str, Any]) -> dict[str, Any]:
    """flatten -> the bytes a store writes (safetensors + JSON metadata) -> unflatten."""
    tensors, meta = st.flatten_optimizer(state)
    blob = st_save(tensors, metadata={"opt": st.dumps(meta)})
    (n,) = struct.unpack("<Q", blob[:8])
    text = json.loads(blob[8:8 + n])["__metadata__"]["opt"]
    return st.unflatten_optimizer(st_load(blob), st.loads(text))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_round_trips_exactly(name: str) -> None:
    model = make_mlp(8, 3, hidden=8, seed=1)
    opt = OPTIMIZERS[name](model.parameters())
    _train(model, opt, 3)
    original = opt.state_dict()
    back = _through_safetensors(original)
    _same(original, back)
    # ...and loads into a fresh optimizer, which then holds the same state
    other = OPTIMIZERS[name](make_mlp(8, 3, hidden=8, seed=1).parameters())
    other.load_state_dict(back)
    _same(original, other.state_dict())


def test_lbfgs_state_has_the_shapes_that_used_to_be_refused() -> None:
    model = make_mlp(8, 3, hidden=8, seed=1)
    opt = OPTIMIZERS["lbfgs"](model.parameters())
    _train(model, opt, 3)
    entry = opt.state_dict()["state"][0]
    assert isinstance(entry["old_dirs"], list) and entry["old_dirs"] and isinstance(entry["old_dirs"][0], torch.Tensor)
    assert isinstance(entry["n_iter"], int) and isinstance(entry["prev_loss"], float)
    tensors, meta = st.flatten_optimizer(opt.state_dict())
    assert "optim/0/old_dirs/0" in tensors and "optim/0/d" in tensors  # plain, path-derived names


def test_tensor_learning_rate_is_a_tensor_after_the_round_trip() -> None:
    model = make_mlp(8, 3, hidden=8, seed=1)
    opt = OPTIMIZERS["adam_tensor_lr"](model.parameters())
    _train(model, opt, 2)
    tensors, _ = st.flatten_optimizer(opt.state_dict())
    assert "optim/param_groups/0/lr" in tensors
    back = _through_safetensors(opt.state_dict())
    assert isinstance(back["param_groups"][0]["lr"], torch.Tensor) and back["param_groups"][0]["lr"].item() == \
        pytest.approx(1e-2)


def test_structures_round_trip_exactly() -> None:
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    state = {"state": {0: {"k": [t, (1, 2.5, None, True), [], {"nested": [t.T.contiguous()]}],
                           "same": t, "nan": float("nan"), "inf": float("-inf"), "s": "text",
                           "intkeys": {3: "a", 7: [None]}, "tricky": {"__tensor__": "x"}, "tup": {"__tuple__": 1}}},
             "param_groups": [{"params": [0], "lr": torch.tensor(0.1, dtype=torch.float64), "betas": (0.9, 0.99)}]}
    back = _through_safetensors(state)
    _same(state, back)
    assert back["state"][0]["same"] is back["state"][0]["k"][0]  # one tensor object stays one


@pytest.mark.parametrize(("bad", "where"), [
    ({1, 2}, "state/0/bad"),
    (object(), "state/0/bad"),
    ([1, {"deep": torch.device("cpu")}], "state/0/bad/1/deep"),
    ({(1, 2): 3}, "state/0/bad"),
])
def test_unserialisable_values_are_refused_naming_the_path(bad: Any, where: str) -> None:
    state = {"state": {0: {"ok": torch.zeros(2), "bad": bad}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    with pytest.raises(UncheckpointableStateError, match=where):
        st.flatten_optimizer(state)


def test_old_checkpoint_optimizer_metadata_still_loads() -> None:
    """Checkpoints written before the structured format (tensor_keys/scalars) resume as before."""
    t = torch.ones(3)
    meta = st.loads(st.dumps({"param_groups": [{"params": [0], "lr": 0.1, "betas": (0.9, 0.999)}],
                              "scalars": {"0": {"n": 2}}, "tensor_keys": {"0": ["exp_avg"]}}))
    back = st.unflatten_optimizer({"optim/0/exp_avg": t}, meta)
    assert back["state"][0]["n"] == 2 and back["state"][0]["exp_avg"] is t
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)


def test_missing_tensor_is_corrupt() -> None:
    model = make_mlp(8, 3, hidden=8, seed=1)
    opt = OPTIMIZERS["lbfgs"](model.parameters())
    _train(model, opt, 2)
    tensors, meta = st.flatten_optimizer(opt.state_dict())
    del tensors["optim/0/d"]
    with pytest.raises(CheckpointCorruptError, match="optim/0/d"):
        st.unflatten_optimizer(tensors, st.loads(st.dumps(meta)))


def test_lbfgs_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """LBFGS needs a closure, so this resume is a hand loop through a checkpoint store."""
    ref = make_mlp(8, 3, hidden=8, seed=1)
    ref_opt = OPTIMIZERS["lbfgs"](ref.parameters())
    _train(ref, ref_opt, 6)

    model = make_mlp(8, 3, hidden=8, seed=1)
    opt = OPTIMIZERS["lbfgs"](model.parameters())
    _train(model, opt, 3)
    store = SafetensorsCheckpointStore(tmp_path)
    tensors, meta = st.flatten_optimizer(opt.state_dict())
    tensors.update(st.snapshot_tensors({f"model/{k}": v for k, v in model.state_dict().items()}))
    store.save(3, tensors, {"optim": st.dumps(meta)})

    loaded = store.load()
    fresh = make_mlp(8, 3, hidden=8, seed=42)
    fresh.load_state_dict({k[6:]: v for k, v in loaded.tensors.items() if k.startswith("model/")})
    fresh_opt = OPTIMIZERS["lbfgs"](fresh.parameters())
    fresh_opt.load_state_dict(st.unflatten_optimizer(loaded.tensors, st.loads(loaded.metadata["optim"])))
    _train(fresh, fresh_opt, 3)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    _same(ref_opt.state_dict(), fresh_opt.state_dict())


def _cfg(tmp: Path, **kw) -> TrainingConfig:  # noqa: ANN003
    base = dict(epochs=2, batch_size=8, grad_accumulation=2, seed=4, output_dir=tmp, log_every=1, device="cpu")
    return TrainingConfig(**(base | kw))


@pytest.mark.parametrize("name", ["adam_tensor_lr", "adamw_amsgrad"])
def test_trainer_resume_with_tensor_lr_equals_uninterrupted(tmp_path: Path, name: str) -> None:
    data = SyntheticClassification(samples=80, features=8, classes=3, seed=2)
    ref = make_mlp(8, 3, hidden=16, dropout=0.3, seed=1)
    Trainer(ref, data, _cfg(tmp_path / "ref"), optimizer=OPTIMIZERS[name]).fit()

    first = Trainer(make_mlp(8, 3, hidden=16, dropout=0.3, seed=1), data, _cfg(tmp_path / "run", max_steps=3),
                    optimizer=OPTIMIZERS[name]).fit()
    assert first.steps == 3
    fresh = make_mlp(8, 3, hidden=16, dropout=0.3, seed=99)
    torch.manual_seed(12345)
    trainer = Trainer(fresh, data, _cfg(tmp_path / "run"), optimizer=OPTIMIZERS[name])
    second = trainer.fit()
    assert second.resumed_from == 3 and second.steps == 10
    for k, v in ref.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    if name == "adam_tensor_lr":
        assert trainer.optimizer is not None and isinstance(trainer.optimizer.param_groups[0]["lr"], torch.Tensor)


def test_dict_list_tuple_and_number_subclasses_are_stored_as_their_base_type() -> None:
    """Opacus' privacy accountant keeps an OrderedDict; before, the walk refused every subclass
    (the DP training tests failed: 'a value of type collections.OrderedDict cannot be checkpointed')."""
    import collections
    import enum

    import numpy as np

    from securetrain.training import state as st

    class Level(enum.IntEnum):
        HIGH = 2

    Point = collections.namedtuple("Point", "x y")
    value = {"acc": collections.OrderedDict([("b", 1), ("a", [np.float64(0.5)])]),
             "d": collections.defaultdict(list, {"k": [1]}), "level": Level.HIGH, "pt": Point(1, 2)}
    back = st.loads(st.dumps(value))
    assert back == {"acc": {"b": 1, "a": [0.5]}, "d": {"k": [1]}, "level": 2, "pt": (1, 2)}
    assert list(back["acc"]) == ["b", "a"] and type(back["level"]) is int and type(back["pt"]) is tuple


class _DeviceInGroup(torch.optim.SGD):
    """A param group holding a torch.device (no checkpoint form)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        for group in self.param_groups:
            group["device"] = torch.device("cpu")


class _SetInStateAfterStep(torch.optim.SGD):
    """Per-parameter state that only exists after the first step, holding a set."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        for p in self.param_groups[0]["params"]:
            self.state[p]["seen"] = {1, 2}
        return out


class _SetStateCallback(TrainerCallback):
    def state_dict(self) -> dict[str, Any]:
        return {"tags": {"a"}}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _CountSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.steps = metrics.step


def test_uncheckpointable_param_group_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """Found before any training time is spent, not at the first checkpoint (here: only at the end)."""
    counter = _CountSteps()
    model = make_mlp(8, 3, hidden=8, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, SyntheticClassification(samples=80, features=8, classes=3, seed=2),
                      _cfg(tmp_path), optimizer=_DeviceInGroup, callbacks=[counter])
    with pytest.raises(UncheckpointableStateError, match="param_groups/0/device") as info:
        trainer.fit()
    assert "torch.device" in str(info.value)
    assert counter.steps == 0 and trainer.progress.step == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_uncheckpointable_optimizer_state_is_refused_at_step_one(tmp_path: Path) -> None:
    trainer = Trainer(make_mlp(8, 3, hidden=8, seed=1), SyntheticClassification(samples=80, features=8, classes=3, seed=2),
                      _cfg(tmp_path, epochs=5), optimizer=_SetInStateAfterStep)
    with pytest.raises(UncheckpointableStateError, match="state/0/seen"):
        trainer.fit()
    assert trainer.progress.step == 1
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_uncheckpointable_callback_state_is_refused_before_the_first_step(tmp_path: Path) -> None:
    trainer = Trainer(make_mlp(8, 3, hidden=8, seed=1), SyntheticClassification(samples=80, features=8, classes=3, seed=2),
                      _cfg(tmp_path), callbacks=[_SetStateCallback()])
    with pytest.raises(UncheckpointableStateError, match="_SetStateCallback/tags"):
        trainer.fit()
    assert trainer.progress.step == 0

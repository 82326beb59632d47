"""A normalisation layer of the user's own whose groups hold one value per sample outputs its bias
whatever its input (the model learns nothing before it): refused before training, naming the layer;
layers that normalise two values or more are not (no false positives), and the check leaves no trace."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.errors import ConfigError
from securetrain.training import ConstantNormError, SafetensorsCheckpointStore, Trainer, TrainingConfig, TrainingError
from securetrain.training.synthetic import SyntheticClassification

torch.set_num_threads(1)


def _data(n: int = 48) -> SyntheticClassification:
    return SyntheticClassification(samples=n, features=8, classes=3, seed=2)


def _cfg(tmp: Path, **kw) -> TrainingConfig:  # noqa: ANN003
    base = dict(epochs=1, batch_size=8, lr=5e-3, seed=4, output_dir=tmp, log_every=1, device="cpu")
    return TrainingConfig(**(base | kw))


def _net(*middle: nn.Module) -> nn.Module:
    """Linear(8, 8), then ``middle`` at path "1" (a Sequential), then a 3-class head over 8 features."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(*middle), nn.Linear(8, 3))


def _maps(h: int) -> list[nn.Module]:
    """[N, 8] -> [N, 2, 2, 2] -> conv to 8 channels of h x h (h=1: what global pooling leaves)."""
    return [nn.Unflatten(1, (2, 2, 2)), nn.Conv2d(2, 8, 2 if h == 1 else 1), nn.AdaptiveAvgPool2d(h)]


CONSTANT = {
    "groupnorm-flat": ([nn.GroupNorm(8, 8), nn.ReLU()], "1.0 (GroupNorm(8, 8) over inputs of per-sample shape [8]"),
    "groupnorm-pooled": ([*_maps(1), nn.GroupNorm(8, 8), nn.Flatten()],
                         "1.3 (GroupNorm(8, 8) over inputs of per-sample shape [8, 1, 1]"),
    "instancenorm-1x1": ([*_maps(1), nn.InstanceNorm2d(8, affine=True), nn.Flatten()],
                         "1.3 (InstanceNorm2d(8) over inputs of per-sample shape [8, 1, 1]"),
    "layernorm-1": ([nn.Unflatten(1, (8, 1)), nn.LayerNorm(1), nn.Flatten()],
                    "1.1 (LayerNorm((1,)) over inputs of per-sample shape [8, 1]"),
}


@pytest.mark.parametrize("case", sorted(CONSTANT))
def test_a_norm_of_one_value_per_group_is_refused_before_training(tmp_path: Path, case: str) -> None:
    middle, named = CONSTANT[case]
    audit = MemoryAuditRecorder()
    trainer = Trainer(_net(*copy.deepcopy(middle)), _data(), _cfg(tmp_path), audit=audit,
                      store=SafetensorsCheckpointStore(tmp_path / "ckpt"))
    with pytest.raises(ConstantNormError) as info:
        trainer.fit()
    assert isinstance(info.value, TrainingError) and isinstance(info.value, ConfigError)
    message, hint = str(info.value), info.value.hint or ""
    assert named in message and "1 value per group" in message and "outputs its bias whatever its input" in message
    assert "nn.LayerNorm(C)" in hint
    assert not any(e["action"] in ("training.start", "training.step") for e in audit.events)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())  # nothing trained or saved


def test_the_refused_layer_really_erases_its_input() -> None:
    """What the refusal is about: the model's output does not depend on its input (torch itself
    raises an untyped ValueError for InstanceNorm on 1x1 maps, at the first training step)."""
    for case, (middle, _) in CONSTANT.items():
        model = _net(*copy.deepcopy(middle))
        if case.startswith("instancenorm"):
            with pytest.raises(ValueError, match="more than 1 spatial element"):
                model(torch.randn(4, 8))
            continue
        a, b = model(torch.randn(4, 8)), model(torch.randn(4, 8))
        assert torch.allclose(a, b, atol=1e-4) and torch.allclose(a, a[:1].expand_as(a), atol=1e-4), case


SOUND = {
    "groupnorm-2-per-group": [nn.GroupNorm(4, 8), nn.ReLU()],
    "layernorm-8": [nn.LayerNorm(8), nn.ReLU()],
    "groupnorm-maps": [*_maps(2), nn.GroupNorm(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten()],
    "instancenorm-maps": [*_maps(2), nn.InstanceNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten()],
    "groupnorm-one-group": [nn.GroupNorm(1, 8), nn.Dropout(0.3)],
}


@pytest.mark.parametrize("case", sorted(SOUND))
def test_norms_over_two_values_or_more_train(tmp_path: Path, case: str) -> None:
    result = Trainer(_net(*copy.deepcopy(SOUND[case])), _data(), _cfg(tmp_path),
                     store=SafetensorsCheckpointStore(tmp_path / "ckpt")).fit()
    assert result.reason == "completed" and result.steps == 6


def test_the_check_leaves_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model the check runs a forward for (GroupNorm(8, 8), InstanceNorm: could be one value per
    group) and passes, with dropout: the same weights as a run without the check."""
    middle = [*_maps(2), nn.GroupNorm(8, 8), nn.InstanceNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
              nn.Dropout(0.3)]

    def fit(where: str) -> nn.Module:
        model = _net(*copy.deepcopy(middle))
        Trainer(model, _data(), _cfg(tmp_path / where, epochs=2),
                store=SafetensorsCheckpointStore(tmp_path / where / "c")).fit()
        return model

    checked = fit("checked")
    calls: list[int] = []
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_refuse_constant_norms", lambda self: calls.append(1))
        unchecked = fit("unchecked")
    assert calls == [1]
    for (k, a), b in zip(checked.state_dict().items(), unchecked.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_iterable_data_is_checked_too(tmp_path: Path) -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # noqa: ANN204
            yield from _data()

    with pytest.raises(ConstantNormError, match=r"1\.0 \(GroupNorm\(8, 8\)"):
        Trainer(_net(nn.GroupNorm(8, 8)), Stream(), _cfg(tmp_path),
                store=SafetensorsCheckpointStore(tmp_path / "ckpt")).fit()

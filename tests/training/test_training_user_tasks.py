"""A user's own model and task through the Trainer's defaults: outputs that are tuples/dicts,
regression, multi-label, segmentation, several inputs, loss modules with class weights,
ReduceLROnPlateau, and validation problems found before training instead of after an epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from two_inputs import TwoInputs

from securetrain.training import MetricsHistory, ResumeMismatchError, Trainer, TrainingConfig, TrainingError
from securetrain.training.validation import default_metrics

torch.set_num_threads(1)

G = torch.Generator().manual_seed(0)
X = torch.randn(40, 6, generator=G)
Y = torch.randint(0, 3, (40,), generator=G)
CLS = TensorDataset(X, Y)


def _cfg(tmp: Path, **kw: Any) -> TrainingConfig:
    base: dict[str, Any] = dict(epochs=2, batch_size=8, seed=1, output_dir=tmp, device="cpu", log_every=1)
    return TrainingConfig(**(base | kw))


class DictNet(nn.Module):
    """Returns a dict with 'logits' (as Hugging Face models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(x), "embedding": x}


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lin(x)
        return out, out.sum(dim=1)


def test_dict_output_with_logits_trains_and_validates_by_default(tmp_path: Path) -> None:
    r = Trainer(DictNet(), CLS, _cfg(tmp_path), eval_data=CLS).fit()
    assert r.validation[-1]["samples"] == 40 and "auc" in r.validation[-1]


def test_tuple_output_with_own_loss_predict_and_metrics(tmp_path: Path) -> None:
    """Validation joins tuple outputs per element (before: AttributeError 'tuple' has no 'float')."""
    seen: list[Any] = []

    def metrics(outputs: Any, targets: torch.Tensor) -> dict[str, Any]:
        seen.append(outputs)
        logits, total = outputs
        return {"loss": float(F.cross_entropy(logits, targets)), "total": float(total.mean())}

    r = Trainer(TupleNet(), CLS, _cfg(tmp_path), eval_data=CLS, metrics_fn=metrics,
                loss_fn=lambda m, b: F.cross_entropy(m(b[0])[0], b[1])).fit()
    assert r.reason == "completed" and isinstance(seen[-1], tuple) and seen[-1][0].shape == (40, 3)


def test_tuple_output_with_default_validation_is_refused_before_training(tmp_path: Path) -> None:
    steps = MetricsHistory()
    with pytest.raises(TrainingError, match="returned tuple"):
        Trainer(TupleNet(), CLS, _cfg(tmp_path), eval_data=CLS, callbacks=[steps],
                loss_fn=lambda m, b: F.cross_entropy(m(b[0])[0], b[1])).fit()
    assert steps.history == []


def test_missing_validation_metric_is_refused_before_training(tmp_path: Path) -> None:
    steps = MetricsHistory()
    reg = TensorDataset(X, X[:, :1])
    trainer = Trainer(nn.Linear(6, 1), reg, _cfg(tmp_path), eval_data=reg, loss_fn=nn.MSELoss(), callbacks=[steps],
                      metrics_fn=lambda o, t: {"mse": float(F.mse_loss(o, t))})
    with pytest.raises(TrainingError, match="'loss' is not one of the validation metrics.*before training"):
        trainer.fit()
    assert steps.history == [] and trainer.progress.step == 0


def test_regression_with_mse_module_and_default_metrics(tmp_path: Path) -> None:
    """[N, 1] predictions of [N] targets: the loss module sees [N] vs [N] (no [N, N] broadcast)."""
    y = X[:, 0] * 2 + 0.5
    data = TensorDataset(X, y)
    r = Trainer(nn.Linear(6, 1), data, _cfg(tmp_path, epochs=20, lr=0.05), loss_fn=nn.MSELoss(), eval_data=data).fit()
    last = r.validation[-1]
    assert {"loss", "mae", "rmse", "r2"} <= set(last) and last["r2"] > 0.9


@pytest.mark.parametrize("target", ["float_1d", "multi_hot"])
def test_default_loss_refuses_regression_and_multilabel_targets(tmp_path: Path, target: str) -> None:
    """Before: a [N] float output was read as one sample of N classes, multi-hot rows as soft labels
    (softmax cross-entropy): both trained silently on the wrong objective."""
    if target == "float_1d":
        model: nn.Module = nn.Sequential(nn.Linear(6, 1), nn.Flatten(0))
        data = TensorDataset(X, X[:, 0])
        match = "outputs of shape \\[8\\]"
    else:
        model, data, match = nn.Linear(6, 4), TensorDataset(X, (X[:, :4] > 0).float()), "BCEWithLogitsLoss"
    with pytest.raises(TrainingError, match=match):
        Trainer(model, data, _cfg(tmp_path)).fit()


def test_multilabel_with_bce_and_default_metrics(tmp_path: Path) -> None:
    data = TensorDataset(X, (X[:, :4] > 0).float())
    r = Trainer(nn.Linear(6, 4), data, _cfg(tmp_path, epochs=10, lr=0.05), loss_fn=nn.BCEWithLogitsLoss(),
                eval_data=data).fit()
    last = r.validation[-1]
    assert {"loss", "accuracy", "exact_match", "auc", "label_counts"} <= set(last) and last["auc"] > 0.8


def test_segmentation_outputs_are_scored_per_pixel(tmp_path: Path) -> None:
    xs = torch.randn(16, 1, 8, 8, generator=G)
    data = TensorDataset(xs, (xs[:, 0] > 0).long())
    r = Trainer(nn.Conv2d(1, 2, 3, padding=1), data, _cfg(tmp_path, epochs=5, lr=0.05), eval_data=data).fit()
    last = r.validation[-1]
    assert last["samples"] == 16 and sum(last["class_counts"]) == 16 * 64
    assert last["accuracy"] > 0.8 and 0 < last["mean_iou"] <= 1 and 0 < last["dice"] <= 1


T2 = torch.randn(40, 2, generator=G)


class PairData(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        return (X[i], T2[i]), Y[i]


class NamedData(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        return {"image": X[i], "clinical": T2[i], "label": Y[i]}


@pytest.mark.parametrize("data", [PairData(), NamedData()], ids=["tuple", "dict"])
def test_model_with_two_inputs_gets_them_spread(tmp_path: Path, data: Dataset) -> None:
    model = TwoInputs()
    r = Trainer(model, data, _cfg(tmp_path, num_workers=0), eval_data=data).fit()
    assert r.reason == "completed" and r.validation[-1]["samples"] == 40


def test_class_weights_through_a_loss_module(tmp_path: Path) -> None:
    w = torch.tensor([1.0, 2.0, 3.0])
    a, b = nn.Linear(6, 3), nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    Trainer(a, CLS, _cfg(tmp_path / "a"), loss_fn=nn.CrossEntropyLoss(weight=w)).fit()
    Trainer(b, CLS, _cfg(tmp_path / "b"), loss_fn=lambda m, bt: F.cross_entropy(m(bt[0]), bt[1], weight=w)).fit()
    assert torch.equal(a.weight, b.weight)


def test_reduce_lr_on_plateau_steps_per_validation(tmp_path: Path) -> None:
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5,
                                                         threshold=10.0, threshold_mode="abs")
    cfg = _cfg(tmp_path, epochs=4, validation={"metric": "accuracy"})
    r = Trainer(model, CLS, cfg, optimizer=opt, scheduler=plateau, eval_data=CLS).fit()
    assert r.reason == "completed"
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)  # every validation after the first: no gain
    with pytest.raises(TrainingError, match="ReduceLROnPlateau"):
        m2 = nn.Linear(6, 3)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
        Trainer(m2, CLS, _cfg(tmp_path / "x"), optimizer=o2,
                scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(o2)).fit()


def test_default_metrics_pick_by_shape() -> None:
    z = torch.randn(10, 3)
    assert "confusion" in default_metrics(z, torch.randint(0, 3, (10,)))
    assert "r2" in default_metrics(torch.randn(10, 1), torch.randn(10))
    assert "exact_match" in default_metrics(z, (torch.randn(10, 3) > 0).float())
    assert "exact_match" in default_metrics(torch.randn(10, 1), torch.randint(0, 2, (10,)))
    soft = torch.softmax(torch.randn(10, 3), dim=1)
    assert "confusion" in default_metrics(z, soft)


class Augmented(Dataset):
    """Random augmentation in __getitem__ (torch, numpy and random draws), as image pipelines do."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        import random

        import numpy as np

        noise = 0.1 * torch.randn(6) + float(np.random.normal()) * 0.01 + random.random() * 0.01
        return X[i] + noise, Y[i]


class _StopAt(MetricsHistory):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.stop = step

    def on_step(self, trainer: Trainer, metrics: Any) -> None:
        super().on_step(trainer, metrics)
        if metrics.step == self.stop:
            trainer.request_stop()


def test_augmentation_in_loader_workers_resumes_bit_identically(tmp_path: Path) -> None:
    """With num_workers > 0 a resumed epoch hands the remaining samples to the workers in another
    order of draws; each sample's randomness is now seeded from (seed, epoch, index)."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    ref = model()
    Trainer(ref, Augmented(), _cfg(tmp_path / "ref", num_workers=2)).fit()
    first = Trainer(model(), Augmented(), _cfg(tmp_path / "run", num_workers=2), callbacks=[_StopAt(3)]).fit()
    assert first.reason == "preempted"
    resumed = model()
    second = Trainer(resumed, Augmented(), _cfg(tmp_path / "run", num_workers=2)).fit()
    assert second.resumed_from == 3
    for k, v in ref.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_custom_metrics_may_return_tensors_and_numpy_values(tmp_path: Path) -> None:
    """torchmetrics returns tensors, scikit-learn numpy scalars and arrays: they are stored as plain
    numbers and lists (before: the first checkpoint after a validation refused the tensor)."""
    import numpy as np

    def metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        per_class = torch.stack([(outputs.argmax(1)[targets == c] == c).float().mean() for c in range(3)])
        return {"loss": F.cross_entropy(outputs, targets), "recall": per_class,
                "f1": np.float32(0.5), "support": np.bincount(targets.numpy(), minlength=3), "n": np.int64(40)}

    r = Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path), eval_data=CLS, metrics_fn=metrics).fit()
    last = r.validation[-1]
    assert type(last["loss"]) is float and type(last["f1"]) is float and type(last["n"]) is int
    assert isinstance(last["recall"], list) and len(last["recall"]) == 3 and last["support"] == [11, 19, 10]
    assert r.checkpoint is not None


def test_metric_values_without_a_stored_form_are_refused_before_training(tmp_path: Path) -> None:
    trainer = Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path), eval_data=CLS,
                      metrics_fn=lambda o, t: {"loss": 1.0, "classes": {0, 1, 2}})
    with pytest.raises(TrainingError, match="classes"):
        trainer.fit()
    assert trainer.progress.step == 0


class Stream(torch.utils.data.IterableDataset):
    """Unsized data (a stream / database cursor): the epoch's last accumulation window is short."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(40):
            yield X[i], Y[i]


def test_short_last_window_of_unsized_data_is_a_full_step(tmp_path: Path) -> None:
    """5 micro-batches, accumulation 2: the third step (the short tail) is logged, checkpointed by
    checkpoint_every and stops at max_steps like any other step (before: none of that)."""
    history = MetricsHistory()
    r = Trainer(nn.Linear(6, 3), Stream(), _cfg(tmp_path, grad_accumulation=2, checkpoint_every=3,
                                                checkpoint_at_end=False, epochs=2, max_steps=3),
                callbacks=[history]).fit()
    assert r.steps == 3 and r.epoch == 0
    assert [m.step for m in history.history] == [1, 2, 3]
    assert [c.step for c in history.checkpoints] == [3]


def test_class_weights_from_the_config(tmp_path: Path) -> None:
    """training.class_weights: a list, or 'balanced' (n / (classes x count), from the training labels),
    for the default loss, so config-only users (securetrain run / train) can weight rare classes."""
    w = [1.0, 2.0, 3.0]
    a, b = nn.Linear(6, 3), nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    Trainer(a, CLS, _cfg(tmp_path / "a", class_weights=w)).fit()
    Trainer(b, CLS, _cfg(tmp_path / "b"), loss_fn=nn.CrossEntropyLoss(weight=torch.tensor(w))).fit()
    assert torch.equal(a.weight, b.weight)

    counts = torch.bincount(Y, minlength=3).double()
    balanced = (len(Y) / (3 * counts)).float()
    c, d = nn.Linear(6, 3), nn.Linear(6, 3)
    d.load_state_dict(c.state_dict())

    class Rows(Dataset):  # no labels attribute: read by iterating
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> Any:
            return {"features": X[i], "label": Y[i]}

    Trainer(c, Rows(), _cfg(tmp_path / "c", class_weights="balanced")).fit()
    Trainer(d, CLS, _cfg(tmp_path / "d"), loss_fn=nn.CrossEntropyLoss(weight=balanced)).fit()
    assert torch.allclose(c.weight, d.weight, atol=1e-6)

    with pytest.raises(TrainingError, match="class_weights"):
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "e", class_weights=w), loss_fn=nn.MSELoss()).fit()
    with pytest.raises(TrainingError, match="3 classes.*2 class weights"):
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "f", class_weights=[1.0, 2.0])).fit()


@pytest.mark.parametrize(("loss_fn", "match"), [
    (lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), "per-sample losses of shape \\[8\\]"),
    (lambda m, b: float(F.cross_entropy(m(b[0]), b[1])), "returned float"),
], ids=["unreduced", "float"])
def test_a_loss_that_is_not_a_scalar_tensor_is_refused_with_a_hint(tmp_path: Path, loss_fn: Any, match: str) -> None:
    with pytest.raises(TrainingError, match=match) as info:
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path), loss_fn=loss_fn).fit()
    assert "loss_fn" in str(info.value)


def test_string_labels_are_refused_with_a_hint(tmp_path: Path) -> None:
    class Named(Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> Any:
            return X[i], ["benign", "malignant", "normal"][int(Y[i])]

    with pytest.raises(TrainingError, match="targets.*list.*class ids"):
        Trainer(nn.Linear(6, 3), Named(), _cfg(tmp_path)).fit()


@pytest.mark.parametrize("name", ["cosine", "onecycle"])
def test_resume_with_a_longer_run_than_the_schedule_planned_is_refused(tmp_path: Path, name: str) -> None:
    """cosine/onecycle are planned for the run's length; resumed with more epochs, the loaded
    schedule ran past its end (cosine climbed back to the full lr; OneCycleLR raised ValueError
    mid-run). Now refused at resume, naming both lengths; the same length still resumes."""
    sched = {"name": name}
    Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path, scheduler=sched)).fit()
    again = Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path, scheduler=sched)).fit()
    assert again.resumed_from == 10
    with pytest.raises(ResumeMismatchError, match="planned for 10 optimizer steps.*20"):
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path, epochs=4, scheduler=sched)).fit()
    Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "constant")).fit()  # no length-planned schedule:
    longer = Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "constant", epochs=4)).fit()  # may run longer
    assert longer.resumed_from == 10 and longer.steps == 20


def test_single_sample_last_batch_with_batchnorm_is_refused_at_the_first_step(tmp_path: Path) -> None:
    """41 rows, batch_size 8: every epoch ends with a 1-sample batch, which BatchNorm1d cannot
    normalise on [N, C] inputs; that ValueError came from torch at the end of the first epoch."""
    x, y = torch.randn(41, 6, generator=G), torch.randint(0, 3, (41,), generator=G)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    trainer = Trainer(model, TensorDataset(x, y), _cfg(tmp_path))
    with pytest.raises(TrainingError, match="1 sample.*BatchNorm1d") as info:
        trainer.fit()
    assert "drop_last" in str(info.value) and trainer.progress.step == 0
    r = Trainer(model, TensorDataset(x, y), _cfg(tmp_path / "ok", drop_last=True)).fit()
    assert r.steps == 10
    conv = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), nn.Flatten(), nn.Linear(24, 3))
    r = Trainer(conv, TensorDataset(x.unsqueeze(1), y), _cfg(tmp_path / "ecg")).fit()  # [N, C, L]: fine
    assert r.steps == 12


def test_optimizer_from_the_config(tmp_path: Path) -> None:
    """training.optimizer picks any torch.optim class by name (config-only users had AdamW only),
    with lr / weight_decay from the config and the rest from kwargs; LBFGS gets its closure."""
    a, b = nn.Linear(6, 3), nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    cfg = _cfg(tmp_path / "a", lr=0.1, optimizer={"name": "sgd", "kwargs": {"momentum": 0.9, "nesterov": True}})
    trainer = Trainer(a, CLS, cfg)
    trainer.fit()
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    Trainer(b, CLS, _cfg(tmp_path / "b", lr=0.1),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)).fit()
    assert torch.equal(a.weight, b.weight)

    loaded = TrainingConfig.model_validate({"optimizer": {"name": "LBFGS", "kwargs": {"max_iter": 3}},
                                            "grad_clip": None, "epochs": 1, "batch_size": 8,
                                            "output_dir": str(tmp_path / "l"), "device": "cpu"})
    assert Trainer(nn.Linear(6, 3), CLS, loaded).fit().steps == 5
    with pytest.raises(TrainingError, match="optimizer 'adamw' rejected its arguments.*momentum"):
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "x", optimizer={"name": "adamw", "kwargs": {"momentum": 1}})).fit()
    with pytest.raises(TrainingError, match="not a torch.optim optimizer.*sgd"):
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "y", optimizer={"name": "sgdd"})).fit()
    with pytest.raises(TrainingError, match="training.optimizer"):
        Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path / "z", optimizer={"name": "sgd"}),
                optimizer=lambda p: torch.optim.Adam(p))


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_class_ids_in_a_column_vector_are_class_ids(tmp_path: Path, dtype: torch.dtype) -> None:
    """Labels taken as df[["label"]].values are [N, 1]; the default loss and metrics read them as [N]
    (before: refused by the metrics, and cross_entropy's 'multi-target not supported')."""
    data = TensorDataset(X, Y.unsqueeze(1).to(dtype))
    r = Trainer(nn.Linear(6, 3), data, _cfg(tmp_path), eval_data=data).fit()
    assert r.validation[-1]["samples"] == 40 and "confusion" in r.validation[-1]


def test_lazy_modules_are_materialised_before_the_optimizer(tmp_path: Path) -> None:
    """nn.LazyLinear infers its sizes on the first forward; the optimizer (and the audit's parameter
    count) came first and failed on the uninitialised parameters. One no-grad forward of the first
    batch (eval mode, RNG restored) now materialises them; resume stays bit-identical."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Dropout(0.2), nn.LazyLinear(3))

    ref = model()
    r = Trainer(ref, CLS, _cfg(tmp_path / "ref"), eval_data=CLS).fit()
    assert r.steps == 10 and ref[0].weight.shape == (8, 6)
    Trainer(model(), CLS, _cfg(tmp_path / "run"), callbacks=[_StopAt(4)]).fit()
    resumed = model()
    Trainer(resumed, CLS, _cfg(tmp_path / "run")).fit()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


@pytest.mark.parametrize(("metric", "maximize"), [
    ("loss", False), ("val_loss", False), ("mae", False), ("rmse", False), ("mse", False), ("mape", False),
    ("error_rate", False), ("brier", False), ("perplexity", False), ("hausdorff_distance", False),
    ("auc", True), ("accuracy", True), ("r2", True), ("dice", True), ("mean_iou", True), ("f1", True),
])
def test_auto_mode_minimises_error_metrics(metric: str, maximize: bool) -> None:
    """validation.mode auto maximised every name without 'loss': a regression run selecting on mae
    or rmse kept its worst checkpoint as 'best' and early-stopped on improvements."""
    from securetrain.training.config import ValidationConfig

    assert ValidationConfig(metric=metric).maximize is maximize


class _Seen(Dataset):
    """Records which indices training reads."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        self.seen.add(int(i))
        return X[i], Y[i]


def test_a_subset_sampler_keeps_the_held_out_rows_out_of_training(tmp_path: Path) -> None:
    """DataLoader(full, sampler=SubsetRandomSampler(train_idx)) is a common train/validation split;
    the engine replaced the sampler with its own over the whole dataset, so the held-out rows were
    trained on. The subset is kept (order still resumable and seeded)."""
    from torch.utils.data import DataLoader, SubsetRandomSampler

    data, train_idx = _Seen(), list(range(0, 30))
    loader = DataLoader(data, batch_size=8, sampler=SubsetRandomSampler(train_idx))
    r = Trainer(nn.Linear(6, 3), loader, _cfg(tmp_path)).fit()
    assert data.seen == set(train_idx) and r.steps == 2 * 4


def test_a_weighted_sampler_is_kept_deterministic_and_resumable(tmp_path: Path) -> None:
    """WeightedRandomSampler (oversampling a rare class) was replaced by a uniform shuffle. Now the
    epoch draws by the weights, from a generator seeded by (seed, epoch), so resume is exact."""
    from torch.utils.data import DataLoader, WeightedRandomSampler

    weights = torch.where(Y == 2, 100.0, 1.0)
    data = _Seen()

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=8, sampler=WeightedRandomSampler(weights, num_samples=24))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 3))

    ref = model()
    r = Trainer(ref, loader(), _cfg(tmp_path / "ref")).fit()
    assert r.steps == 2 * 3
    assert sum(int(Y[i] == 2) for i in data.seen) >= len(data.seen) // 2  # the rare class dominates
    Trainer(model(), loader(), _cfg(tmp_path / "run"), callbacks=[_StopAt(2)]).fit()
    resumed = model()
    Trainer(resumed, loader(), _cfg(tmp_path / "run")).fit()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_a_custom_sampler_gets_set_epoch_every_epoch(tmp_path: Path) -> None:
    """A sampler of the user's own kind keeps its DataLoader; one with set_epoch (DistributedSampler's
    convention for a new order per epoch) was never told the epoch, so every epoch had epoch 0's order."""
    from torch.utils.data import DataLoader, Sampler

    class EpochOrder(Sampler[int]):
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __len__(self) -> int:
            return 40

        def __iter__(self):  # type: ignore[no-untyped-def]  # noqa: ANN204
            epoch = self.epochs[-1] if self.epochs else 0
            return iter(torch.randperm(40, generator=torch.Generator().manual_seed(epoch)).tolist())

    sampler = EpochOrder()
    r = Trainer(nn.Linear(6, 3), DataLoader(_Seen(), batch_size=8, sampler=sampler), _cfg(tmp_path, epochs=3)).fit()
    assert r.steps == 15 and sampler.epochs == [0, 1, 2]


def test_iterable_data_with_workers_warns_about_duplicates(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every DataLoader worker iterates an IterableDataset from the start unless it shards itself by
    get_worker_info(): with num_workers 2 each sample is trained on twice. Said once, as a warning."""
    import logging

    with caplog.at_level(logging.WARNING, logger="securetrain.training"):
        r = Trainer(nn.Linear(6, 3), Stream(), _cfg(tmp_path, num_workers=2, epochs=1)).fit()
    assert r.steps == 10  # 2 workers x 40 samples / 8
    assert any("get_worker_info" in rec.getMessage() for rec in caplog.records)


def test_a_metrics_fn_that_needs_the_whole_split_is_not_refused_on_one_batch(tmp_path: Path) -> None:
    """scikit-learn's roc_auc_score raises on a batch with one class; the check before training
    runs metrics_fn on the first held-out batch only, so such a failure is a warning, not a refusal."""
    order = torch.argsort(Y, stable=True)  # sorted by label: the first batch holds one class
    held_out = TensorDataset(X[order], Y[order])

    def metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        if len(set(targets.tolist())) < 2:
            raise ValueError("Only one class present in y_true")
        return {"loss": float(F.cross_entropy(outputs, targets))}

    r = Trainer(nn.Linear(6, 3), CLS, _cfg(tmp_path), eval_data=held_out, metrics_fn=metrics).fit()
    assert len(r.validation) == 2


class WithIds(Dataset):
    """A dict batch with the model's inputs by name plus bookkeeping the model does not take."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        return {"image": X[i], "clinical": T2[i], "record_id": torch.tensor(i), "label": Y[i]}


def test_dict_inputs_pass_only_the_names_forward_takes(tmp_path: Path) -> None:
    r = Trainer(TwoInputs(), WithIds(), _cfg(tmp_path), eval_data=WithIds()).fit()
    assert r.reason == "completed"

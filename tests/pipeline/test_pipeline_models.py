"""model.target resolution and its one-line errors; the output check before any training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from securetrain.errors import ConfigError
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.errors import ModelOutputError, ModelTargetError
from securetrain.pipeline.models import (
    LogisticRegression,
    SmallCNN,
    TabularMLP,
    build_model,
    check_model_output,
    resolve_model_factory,
)

from .pipeline_fixtures import byom_config, small_config_data, three_class_dicom, write_user_model


@pytest.fixture
def user_dir(tmp_path: Path):
    write_user_model(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m == "mynets" or m.startswith("mynets.")]:
        del sys.modules[name]


def test_builtins_by_name_get_the_task_facts() -> None:
    cnn = build_model("cnn", {"channels": 4}, num_classes=3, in_channels=2)
    assert isinstance(cnn, SmallCNN) and cnn.head.out_features == 3 and cnn.trunk[0].in_channels == 2
    mlp = build_model("mlp", {"hidden": [8, 4]}, num_classes=5, in_features=7)
    assert isinstance(mlp, TabularMLP) and mlp(torch.zeros(2, 7)).shape == (2, 5)
    lr = build_model("logistic", {}, num_classes=2, in_features=3, in_channels=1)  # in_channels not accepted: not passed
    assert isinstance(lr, LogisticRegression) and lr.head.in_features == 3
    # Same seed, same initial weights (a rebuilt model matches the trained one's architecture and init).
    a, b = build_model("mlp", {}, num_classes=2, in_features=3, seed=5), build_model("mlp", {}, num_classes=2, in_features=3, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_module_callable_from_the_config_folder(user_dir: Path) -> None:
    model = build_model("mynets:build", {"width": 2}, base_dir=user_dir, num_classes=3)
    assert type(model).__name__ == "TinyNet" and model.classifier.out_features == 3
    assert str(user_dir) not in sys.path  # the folder is on the path only while importing


@pytest.mark.parametrize("target,match", [
    ("nosuchpkg_xyz.nets:build", r"does not import: ModuleNotFoundError"),
    ("mynets:nope", r"has no attribute 'nope'"),
    ("mynets:CONSTANT", r"is not callable \(it is a int\)"),
    ("mynets:returns_dict", r"returned dict, not a torch.nn.Module"),
    ("mynets", r"neither a built-in model nor a registered entry point"),
    ("mynets:", r"is not 'package.module:callable'"),
])
def test_bad_targets_fail_with_one_line(user_dir: Path, target: str, match: str) -> None:
    with pytest.raises(ModelTargetError, match=match) as info:
        build_model(target, {}, base_dir=user_dir, num_classes=3)
    assert "\n" not in str(info.value) and isinstance(info.value, ConfigError)


def test_rejected_kwargs_name_the_target(user_dir: Path) -> None:
    with pytest.raises(ModelTargetError, match=r"'mynets:build' rejected its arguments"):
        build_model("mynets:build", {"depth": 3}, base_dir=user_dir, num_classes=3)


def test_entry_point_group_registers_models_by_name(tmp_path: Path, user_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "site" / "acme_models-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-models\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[securetrain.models]\nacme-tiny = mynets:build\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(user_dir))
    factory = resolve_model_factory("acme-tiny")
    assert factory.__name__ == "build"
    assert build_model("acme-tiny", {}, num_classes=4).classifier.out_features == 4


def test_output_shape_is_checked_against_the_classes() -> None:
    model = build_model("cnn", {"channels": 2, "hidden": 4}, num_classes=2)
    check_model_output(model, torch.zeros(3, 1, 16, 16), 2, target="cnn")
    with pytest.raises(ModelOutputError, match=r"returns \(3, 2\) for a batch of 3; the task has 3 classes"):
        check_model_output(model, torch.zeros(3, 1, 16, 16), 3, target="cnn")
    with pytest.raises(ModelOutputError, match=r"failed on a batch of shape \(3, 2, 16, 16\)"):
        check_model_output(model, torch.zeros(3, 2, 16, 16), 2, target="cnn")


def test_pipeline_refuses_a_mismatched_model_before_training(tmp_path: Path) -> None:
    """A 2-output model on a 3-class set: refused on one batch, before any checkpoint is written."""
    project = tmp_path / "project"
    write_user_model(project)
    source = three_class_dicom(tmp_path / "studies", n_patients=3)
    config_file = project / "run.yaml"
    config_file.write_text(yaml.safe_dump(byom_config(tmp_path, source, model={"target": "mynets:two_outputs"})))
    from securetrain.cli.main import app

    try:
        result = CliRunner().invoke(app, ["run", str(config_file), "--no-prefect"])
    finally:
        sys.modules.pop("mynets", None)
    assert result.exit_code != 0 and isinstance(result.exception, ModelOutputError)
    assert "the task has 3 classes" in str(result.exception)
    run_dir = tmp_path / "runs" / "byom"
    assert (run_dir / "deid" / "train.csv").is_file()  # the data was prepared ...
    assert not list(run_dir.rglob("*.stenc"))  # ... but nothing was trained or checkpointed


def test_bad_target_is_refused_before_any_work(tmp_path: Path) -> None:
    from securetrain.cli.main import app

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config_data(tmp_path, model={"target": "nosuchpkg_xyz:build"})))
    result = CliRunner().invoke(app, ["run", str(config), "--no-prefect"])
    assert result.exit_code != 0 and isinstance(result.exception, ModelTargetError)
    assert not (tmp_path / "runs" / "t" / "raw").exists()


def test_unknown_validation_metric_fails_in_the_preflight(tmp_path: Path) -> None:
    from securetrain.pipeline.stages import preflight

    config = load_pipeline_config(data=small_config_data(tmp_path, training={"validation": {"metric": "f1"}}))
    with pytest.raises(ConfigError, match=r"validation.metric: 'f1'.*loss, accuracy, auc"):
        preflight(config)


def test_legacy_model_section_and_task_forms(tmp_path: Path) -> None:
    old = load_pipeline_config(data=small_config_data(tmp_path, model={"channels": 4, "hidden": 8}))
    assert old.model.target == "cnn" and old.model.kwargs == {"channels": 4, "hidden": 8}
    assert old.task.kind == "dicom-classification"
    custom = load_pipeline_config(data=small_config_data(tmp_path, task="mytasks:make"))
    assert custom.task.kind == "custom" and custom.task.target == "mytasks:make"
    custom = load_pipeline_config(data=small_config_data(tmp_path, task={"target": "mytasks:make", "kwargs": {"a": 1}}))
    assert custom.task.kind == "custom" and custom.task.kwargs == {"a": 1}
    with pytest.raises(ConfigError, match="task"):
        load_pipeline_config(data=small_config_data(tmp_path, task="image-segmentation"))
    with pytest.raises(ConfigError, match="masking policy"):
        load_pipeline_config(data=small_config_data(tmp_path, task="tabular-classification", data={"policy": None}))


def test_example_byom_config_names_a_model_next_to_it() -> None:
    from securetrain.pipeline.stages import preflight

    root = Path(__file__).resolve().parents[2]
    config = load_pipeline_config(root / "examples" / "byom.yaml")
    preflight(config)
    try:
        model = build_model(config.model.target, config.model.kwargs, base_dir=config.base_dir, num_classes=3, in_channels=1)
        check_model_output(model, torch.zeros(2, 1, 32, 32), 3, target=config.model.target)
        assert type(model).__name__ == "SmallResNet" and model.classifier.out_features == 3
    finally:
        sys.modules.pop("user_nets", None)


def test_a_head_without_bias_is_scored_under_he(tmp_path: Path) -> None:
    """A user's classifier whose last nn.Linear has bias=False trains and is HE-scored (the
    feature stage read head.bias and failed with AttributeError after training)."""
    pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")
    project = tmp_path / "project"
    write_user_model(project)
    source = three_class_dicom(tmp_path / "studies", n_patients=3)
    config_file = project / "run.yaml"
    config_file.write_text(yaml.safe_dump(byom_config(
        tmp_path, source, model={"target": "mynets:no_bias_head"}, training={"epochs": 1})))
    from securetrain.cli.main import app

    try:
        result = CliRunner().invoke(app, ["run", str(config_file), "--no-prefect"])
    finally:
        sys.modules.pop("mynets", None)
    assert result.exit_code == 0, result.output[-2000:] + repr(result.exception)
    import json

    he = json.loads((tmp_path / "runs" / "byom" / "result.json").read_text())["he"]
    assert he["samples"] > 0 and he["max_abs_error"] < 1e-3


def test_whole_model_chain_with_bias_free_linear_layers() -> None:
    """The tabular whole-model HE scope carries a chain whose Linear layers have no bias."""
    from torch import nn

    from securetrain.pipeline.stages import _chain_from_tensors, _chain_to_tensors, _he_model_from_chain

    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(5, 4, bias=False), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False)).eval()
    carried = _chain_to_tensors(chain)
    assert carried is not None
    x = torch.randn(6, 5)
    with torch.no_grad():
        assert torch.allclose(_chain_from_tensors(carried)(x), chain(x))
        logits = chain(x)
        assert torch.allclose(_he_model_from_chain(carried)(x).squeeze(1), logits[:, 1] - logits[:, 0], atol=1e-6)


def test_task_labels_that_are_not_class_ids_are_named_as_such() -> None:
    """A custom task whose dataset yields string labels: the one-batch check says the labels must be
    class ids (it blamed the model: 'returns (2, 3) for a batch of None')."""
    from securetrain.pipeline.errors import TaskError
    from securetrain.training.batches import default_predict

    model = build_model("cnn", {"channels": 2, "hidden": 4}, num_classes=3)
    batch = (torch.zeros(2, 1, 16, 16), ["benign", "malignant"])
    with pytest.raises(TaskError, match=r"labels as a list; they must be class ids"):
        check_model_output(model, batch, 3, target="cnn", predict=default_predict)
    check_model_output(model, (torch.zeros(2, 1, 16, 16), torch.tensor([0, 2])), 3, target="cnn", predict=default_predict)


def test_a_factory_that_raises_fails_with_one_line(tmp_path: Path) -> None:
    """A user's factory refusing its settings (ValueError, AssertionError, ...) is a ModelTargetError
    naming the target and the exception, like rejected kwargs (it escaped as a traceback)."""
    pkg = tmp_path / "picky"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "def build(num_classes, width=4):\n"
        "    if width % 8:\n"
        "        raise ValueError(f'width must be a multiple of 8, got {width}')\n"
    )
    try:
        with pytest.raises(ModelTargetError, match=r"'picky:build' failed: ValueError: width must be a multiple of 8"):
            build_model("picky:build", {"width": 4}, base_dir=tmp_path, num_classes=3)
    finally:
        sys.modules.pop("picky", None)


def test_output_check_accepts_what_the_trainer_trains() -> None:
    """A model returning {'logits': ...} (Hugging Face style), and per-pixel logits [N, C, H, W] for
    [N, H, W] masks, train with the Trainer's defaults, so the pipeline's one-batch check takes them."""
    from securetrain.training.batches import default_predict

    class DictHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.head(x)}

    check_model_output(DictHead(), (torch.zeros(2, 4), torch.tensor([0, 2])), 3, target="m:dict",
                       predict=default_predict)
    seg = torch.nn.Conv2d(1, 2, 3, padding=1)
    check_model_output(seg, (torch.zeros(2, 1, 8, 8), torch.zeros(2, 8, 8, dtype=torch.long)), 2, target="m:seg",
                       predict=default_predict)
    with pytest.raises(ModelOutputError, match="3 classes"):
        check_model_output(seg, (torch.zeros(2, 1, 8, 8), torch.zeros(2, 8, 8, dtype=torch.long)), 3,
                           target="m:seg", predict=default_predict)
    with pytest.raises(ModelOutputError, match="must return"):  # dense outputs need dense targets
        check_model_output(seg, (torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long)), 2,
                           target="m:seg", predict=default_predict)


def test_output_check_leaves_the_models_buffers_as_they_were() -> None:
    # The one-batch output check ran a forward on the model that is then trained: a forward that
    # updates a buffer in eval mode too (a counter, a moving average, a quantisation observer) kept
    # what the check's batch did to it.
    from torch import nn

    from securetrain.pipeline.models import check_model_output

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, x):  # noqa: ANN001
            self.calls += 1
            self.seen = self.seen * 0.5 + x.mean(0)  # replaced, not updated in place
            return self.fc(x)

    model = Counting()
    seen = model.seen
    check_model_output(model, torch.randn(2, 4), 3, target="t:m")
    assert model.calls.item() == 0 and model.seen is seen and torch.equal(model.seen, torch.zeros(4))
    assert dict(model.named_buffers()).keys() == {"calls", "seen"}


@pytest.mark.parametrize("regression", [False, True])
def test_output_check_says_what_to_return_for_a_plain_tuple(regression: bool) -> None:
    # A model returning (logits, features) was told to "set the head's output size", which is not
    # what is wrong: the pipeline reads a tensor, or the 'logits' entry of a dict / named tuple.
    from torch import nn

    from securetrain.pipeline.models import check_model_output

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1 if regression else 3)

        def forward(self, x):  # noqa: ANN001
            return self.fc(x), x

    with pytest.raises(ModelOutputError, match=r"returns a tuple, not a tensor of .* nor a dict / named tuple with a 'logits' entry") as err:
        check_model_output(Pair(), torch.randn(2, 4), 1 if regression else 3, target="t:m", regression=regression)
    assert "head's output size" not in str(err.value) and "{'logits': " in str(err.value.hint)

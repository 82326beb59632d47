"""task.target: a user's task (datasets, loss, metrics) named only in the config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.errors import TaskError
from securetrain.pipeline.runner import run_pipeline


pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")

TASK_MODULE = '''
import json
import torch
import torch.nn.functional as F
from securetrain.pipeline.tasks import TaskData
from securetrain.training.validation import classification_metrics

CALLS = []


class Rows(torch.utils.data.Dataset):
    """Dict items under the task's own keys (neither inputs/pixels/features nor label)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"measurements": self.x[i], "outcome": self.y[i]}


class Blobs:
    """Three Gaussian blobs; the user's own loss and an extra metric."""

    def __init__(self, n=120, features=5, smoothing=0.1):
        self.n, self.features, self.smoothing = n, features, smoothing

    def prepare(self, ctx):
        CALLS.append("prepare")
        (ctx.data_dir / "prepared.json").write_text(json.dumps({"n": self.n}))
        return {"rows": self.n}

    def _split(self, seed):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 3, (self.n,), generator=g)
        x = torch.randn(self.n, self.features, generator=g) + 3 * F.one_hot(y, self.features).float()
        return Rows(x, y)

    def build_datasets(self, ctx):
        assert (ctx.data_dir / "prepared.json").is_file()
        return TaskData(train=self._split(1), eval=self._split(2), class_names=["a", "b", "c"],
                        model_facts={"in_features": self.features})

    def loss(self, model, batch):
        CALLS.append("loss")
        return F.cross_entropy(model(batch["measurements"]), batch["outcome"], label_smoothing=self.smoothing)

    def predict(self, model, batch):
        CALLS.append("predict")
        return model(batch["measurements"]), batch["outcome"]

    def metrics(self, outputs, targets):
        m = classification_metrics(outputs, targets)
        recalls = [row[i] / max(1, sum(row)) for i, row in enumerate(m["confusion"])]
        m["balanced_accuracy"] = sum(recalls) / len(recalls)
        return m


def not_a_task(**kwargs):
    return object()
'''


@pytest.fixture
def task_dir(tmp_path: Path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "blobtask.py").write_text(TASK_MODULE)
    yield tmp_path / "project"
    sys.modules.pop("blobtask", None)


def _config(tmp_path: Path, task_dir: Path, tracking: dict | None = None, **task) -> object:  # noqa: ANN003
    data = {
        "name": "custom", "output_dir": str(tmp_path / "runs"),
        "task": {"target": "blobtask:Blobs", "kwargs": {"n": 120}, **task},
        "model": {"target": "mlp", "kwargs": {"hidden": [8]}},
        "training": {"epochs": 3, "batch_size": 16, "lr": 0.02, "log_every": 2,
                     "validation": {"metric": "balanced_accuracy"}},
        "secrets": {"create_demo_secrets": True},
        "tracking": tracking or {},
    }
    path = task_dir / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_pipeline_config(path)


def test_custom_task_trains_with_its_loss_and_metrics(tmp_path: Path, task_dir: Path) -> None:
    mlflow = pytest.importorskip("mlflow", reason="the [mlflow] extra")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = _config(tmp_path, task_dir, tracking={"mlflow_uri": uri, "experiment": "custom-task"})
    result = run_pipeline(config)
    module = sys.modules["blobtask"]
    assert module.CALLS[0] == "prepare" and {"loss", "predict"} <= set(module.CALLS)  # the task's own steps
    t = result.training
    assert t.class_names == ["a", "b", "c"] and result.data_details == {"rows": 120}
    assert t.best["metric"] == "balanced_accuracy" and all("balanced_accuracy" in v for v in t.validation)
    assert t.validation[-1]["balanced_accuracy"] > 0.6  # learnable blobs
    assert result.he is not None and result.he.outputs == 3 and result.he.scope == "head"
    saved = json.loads((config.run_dir / "result.json").read_text())
    assert saved["task"] == "blobtask:Blobs" and saved["training"]["validation"]
    # MLflow got the same numbers (and the artifacts landed under output_dir, not the cwd).
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("custom-task").experiment_id])
    assert run.data.params["model_target"] == "mlp" and run.data.params["classes"] == "a,b,c"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert [m.value for m in history] == pytest.approx([v["accuracy"] for v in t.validation])
    assert run.data.tags["audit_root"] == result.audit.root_hash
    assert list((tmp_path / "runs" / "mlflow-artifacts").rglob("result.json"))


def test_custom_task_errors(tmp_path: Path, task_dir: Path) -> None:
    from securetrain.pipeline.tasks import resolve_task

    with pytest.raises(TaskError, match=r"task.target 'blobtask:not_a_task' returned object, which has no build_datasets"):
        resolve_task(_config(tmp_path, task_dir, target="blobtask:not_a_task"))
    with pytest.raises(TaskError, match=r"task.target 'blobtask:Nope' does not import"):
        resolve_task(_config(tmp_path, task_dir, target="blobtask:Nope"))
    with pytest.raises(TaskError, match=r"rejected task.kwargs"):
        resolve_task(_config(tmp_path, task_dir, kwargs={"bogus": 1}))

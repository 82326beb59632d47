"""What the HE stage evaluates: the whole tabular model when it is a plain chain, else the linear head."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from securetrain.pipeline import stages
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.models import TabularMLP, he_head

from .pipeline_fixtures import small_config_data


def test_chain_round_trip_is_exact_and_tensor_only() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Dropout(0.2), nn.Linear(5, 3)).eval()
    model[1].running_mean.uniform_()
    x = torch.randn(8, 6)
    chain = stages._as_chain(model, x)
    carried = stages._chain_to_tensors(chain)
    assert all(isinstance(v, torch.Tensor) for v in carried.values())
    assert torch.allclose(stages._chain_from_tensors(carried)(x), model(x), atol=1e-6)
    # TabularMLP (trunk + head modules) is a chain too; a model with a skip connection is not.
    mlp = TabularMLP(6, 3, hidden=[4]).eval()
    assert stages._as_chain(mlp, x) is not None

    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 2)

        def forward(self, x):  # noqa: ANN001
            return self.b(x + self.a(x))

    assert stages._as_chain(Skip().eval(), x) is None
    assert stages._chain_to_tensors(nn.Sequential(nn.Linear(6, 2), nn.LayerNorm(2))) is None  # not carriable


def test_two_class_head_is_one_logistic_unit() -> None:
    w, b = torch.randn(2, 4), torch.randn(2)
    x = torch.randn(5, 4)
    logits = x @ w.T + b
    unit = he_head(w, b)
    assert torch.allclose(unit(x)[:, 0], logits[:, 1] - logits[:, 0], atol=1e-6)
    assert he_head(torch.randn(3, 4), torch.randn(3))[0].out_features == 3  # multi-class kept as is


def _features(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    chain = stages._as_chain(model.eval(), x)
    head = model.head
    return {"features": model.trunk(x), "labels": torch.tensor([0, 1] * (len(x) // 2)),
            "head_weight": head.weight.detach(), "head_bias": head.bias.detach(),
            "model_inputs": x, **stages._chain_to_tensors(chain)}


@pytest.mark.parametrize("scope", ["auto", "model"])
def test_he_stage_falls_back_to_the_head_only_when_allowed(tmp_path, monkeypatch, scope: str) -> None:
    from securetrain.he import HEModelError
    import securetrain.he.evaluate as he_eval

    seen = []

    def fake_evaluate(model, features, labels, **kw):  # noqa: ANN001, ANN003
        seen.append(len([m for m in model.modules() if isinstance(m, nn.Linear)]))
        if len(seen) == 1 and seen[0] > 1:
            raise HEModelError("layer 'relu' cannot be evaluated")
        return SimpleNamespace(n_samples=len(features), n_features=features.shape[1], max_abs_error=1e-6,
                               auc_plaintext=0.5, auc_encrypted=0.5, accuracy_plaintext=0.5, accuracy_encrypted=0.5,
                               ms_per_sample_end_to_end=1.0, params={"poly_modulus_degree": 8192}, public_context_bytes=1)

    monkeypatch.setattr(he_eval, "evaluate_encrypted", fake_evaluate)
    config = load_pipeline_config(data=small_config_data(tmp_path, he={"scope": scope}))
    x = torch.randn(6, 4)
    features = _features(TabularMLP(4, 2, hidden=[3]), x)
    if scope == "model":  # asked for the whole model: the HE error is the answer
        with pytest.raises(HEModelError):
            stages.he_evaluate(config, features)
        return
    summary = stages.he_evaluate(config, features)
    assert seen == [2, 1] and summary.scope == "head" and summary.features == 3 and summary.outputs == 1


def test_whole_model_refusal_names_the_layers_at_fault() -> None:
    # he.scope: model on a model HE cannot evaluate whole used to say only "not a plain chain of
    # Linear, ... layers", leaving the user to guess which layer (or the forward) was the problem.
    x = torch.randn(8, 6)
    ln = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4), nn.LeakyReLU(0.1), nn.Linear(4, 2)).eval()
    with pytest.raises(stages.PipelineError, match=r"cannot be evaluated whole under encryption \(he.scope: model\): HE cannot evaluate "
                       r"its layer\(s\) '1' \(LayerNorm\), '2' \(LeakyReLU\)") as err:
        stages.check_whole_model(ln, x)
    assert "he.scope: head" in str(err.value.hint)

    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(6, 4), nn.Linear(4, 2)

        def forward(self, x):  # noqa: ANN001
            return {"logits": self.head(torch.relu(self.body(x)))}

    with pytest.raises(stages.PipelineError, match=r"its forward is not its layers applied one after another"):
        stages.check_whole_model(DictOut().eval(), x)
    chain = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    assert stages.check_whole_model(chain, x) is not None  # a plain chain: its tensors to carry


def test_he_scope_model_on_a_model_he_cannot_evaluate_whole_fails_before_training(tmp_path, monkeypatch) -> None:
    # The refusal came from the HE stage, after the whole training had run.
    import pyarrow.parquet as pq

    from securetrain.masking.tabular import generate_finance_table
    from securetrain.pipeline.runner import run_pipeline

    from .pipeline_fixtures import finance_config

    (tmp_path / "lnnets_he.py").write_text(
        "from torch import nn\n"
        "def build(in_features, num_classes):\n"
        "    return nn.Sequential(nn.Linear(in_features, 8), nn.LayerNorm(8), nn.Dropout(0.5), nn.Linear(8, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "table.parquet"
    pq.write_table(generate_finance_table(80, seed=0), source)
    data = finance_config(tmp_path, data={"source": str(source)}, model={"target": "lnnets_he:build"},
                          he={"enabled": True, "scope": "model"})
    config = load_pipeline_config(data=data)
    with pytest.raises(stages.PipelineError, match=r"HE cannot evaluate its layer\(s\) '1' \(LayerNorm\)"):
        run_pipeline(config)
    assert not list(config.run_dir.rglob("*.stenc"))  # refused before training
    # With he.scope: auto the same model trains (the HE stage scores its head).
    data["he"]["scope"] = "auto"
    data["name"] = "auto"
    assert run_pipeline(load_pipeline_config(data=data)).he.scope == "head"

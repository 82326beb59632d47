"""TabularDataset (masks on load, tensors through DataLoader workers) and the `mask` CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import typer
from torch.utils.data import DataLoader
from typer.testing import CliRunner

from securetrain.masking.tabular.cli import register
from securetrain.masking.tabular.dataset import TabularDataset
from securetrain.masking.tabular.errors import MaskKeyError, TabularMaskingError
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.synthetic import generate_finance_table, write_finance_file

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "policies" / "finance-pii.yaml"
KEY = bytes(range(32))


def test_dataset_tensors_through_workers(tmp_path: Path) -> None:
    src = write_finance_file(tmp_path / "f.parquet", 64, seed=2)
    ds = TabularDataset(src, TabularMasker(POLICY, KEY), target="label", n_buckets=8)
    raw = generate_finance_table(64, seed=2)
    # 3 numeric (amount, hour) ... + hashed one-hots for 9 string columns; notes dropped, label excluded.
    numeric = ["amount", "hour"]
    hashed = ["customer_name", "customer_id", "iban", "card_number", "ssn", "email", "phone", "balance",
              "txn_date", "category"]
    assert ds.n_features == len(numeric) + 8 * len(hashed)
    assert len(ds) == 64 and ds.report.input_sha256
    loader = DataLoader(ds, batch_size=16, num_workers=2, shuffle=False)
    feats, labels = [], []
    for batch in loader:
        assert batch["features"].dtype == torch.float32 and batch["features"].shape[1] == ds.n_features
        feats.append(batch["features"])
        labels.append(batch["label"])
    f = torch.cat(feats)
    assert torch.equal(torch.cat(labels), torch.tensor(raw.column("label").to_pylist(), dtype=torch.int64))
    amount_col = ds.feature_names.index("amount")
    assert torch.allclose(f[:, amount_col], torch.tensor(raw.column("amount").to_pylist(), dtype=torch.float32))
    # Every hashed column contributes exactly one hot bucket per row.
    for name in hashed:
        cols = [i for i, n in enumerate(ds.feature_names) if n.startswith(name + "#")]
        assert torch.all(f[:, cols].sum(dim=1) == 1)
    assert not hasattr(ds, "masker") and "_token_key" not in vars(ds)  # no key material in workers


def test_dataset_string_target_and_errors() -> None:
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "id", "action": "tokenize"}, {"name": "y", "action": "keep"}, {"name": "when", "action": "keep"}]})
    import datetime as dt

    t = pa.table({"id": ["a", "b", None], "y": ["spam", "ham", "spam"],
                  "when": [dt.date(1970, 1, 2), dt.date(1970, 1, 1), None]})
    ds = TabularDataset(t, TabularMasker(p, KEY), target="y", n_buckets=4)
    assert ds.class_names == ["ham", "spam"] and ds.labels.tolist() == [1, 0, 1]
    assert ds[0]["features"][-1].item() == 1.0  # date kept -> days since epoch
    assert ds[2]["features"][:4].sum().item() == 0.0  # null category -> all-zero one-hot
    with pytest.raises(TabularMaskingError, match="target"):
        TabularDataset(t, TabularMasker(p, KEY), target="nope")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dataset_refuses_a_float_target_without_a_value(bad: float) -> None:
    # pandas writes a missing float as NaN, not null: it reached training as a NaN label.
    p = load_policy(data={"policy_version": "1", "columns": [
        {"name": "x", "action": "keep"}, {"name": "y", "action": "keep"}]})
    t = pa.table({"x": [1.0, 2.0, 3.0], "y": [0.5, bad, 1.5]})
    with pytest.raises(TabularMaskingError, match="1 NaN or infinite"):
        TabularDataset(t, TabularMasker(p, KEY), target="y")
    ok = TabularDataset(pa.table({"x": [1.0, 2.0], "y": [0.5, 1.5]}), TabularMasker(p, KEY), target="y")
    assert ok.labels.tolist() == [0.5, 1.5]


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_cli_mask_with_env_key_and_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_finance_file(tmp_path / "in.csv", 40)
    runner = CliRunner()
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", KEY.hex())
    res = runner.invoke(_app(), ["mask", str(src), str(tmp_path / "out.parquet"), "--policy", str(POLICY),
                                 "--report-json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    assert "ssn" in res.output and "redact" in res.output and "policy digest" in res.output
    expected = TabularMasker(POLICY, KEY).read_masked(src)[0]
    assert pq.read_table(tmp_path / "out.parquet").equals(expected)
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == 40
    monkeypatch.delenv("SECURETRAIN_MASK_KEY")
    key_file = tmp_path / "k.hex"
    key_file.write_text(KEY.hex() + "\n")
    os.chmod(key_file, 0o644)
    res = runner.invoke(_app(), ["mask", str(src), str(tmp_path / "o2.parquet"), "-p", str(POLICY),
                                 "--key-file", str(key_file)])
    assert isinstance(res.exception, MaskKeyError) and "chmod 600" in str(res.exception)
    os.chmod(key_file, 0o600)
    res = runner.invoke(_app(), ["mask", str(src), str(tmp_path / "o2.parquet"), "-p", str(POLICY),
                                 "--key-file", str(key_file)])
    assert res.exit_code == 0 and pq.read_table(tmp_path / "o2.parquet").equals(expected)


def test_cli_without_key_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SECURETRAIN_MASK_KEY", raising=False)
    src = write_finance_file(tmp_path / "in.csv", 5)
    res = CliRunner().invoke(_app(), ["mask", str(src), str(tmp_path / "o.csv"), "-p", str(POLICY)])
    assert isinstance(res.exception, MaskKeyError) and not (tmp_path / "o.csv").exists()
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", "zz-not-hex")
    res = CliRunner().invoke(_app(), ["mask", str(src), str(tmp_path / "o.csv"), "-p", str(POLICY)])
    assert isinstance(res.exception, MaskKeyError) and "zz-not-hex" not in str(res.exception)


def test_cli_mask_default_policy_outside_the_source_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--policy` is optional, but its default was the relative path policies/finance-pii.yaml:
    run from anywhere but the repository root, `securetrain mask IN OUT` failed with "policy file
    policies/finance-pii.yaml not found". The default is the shipped policy, found by name."""
    src = write_finance_file(tmp_path / "in.csv", 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", KEY.hex())
    res = CliRunner().invoke(_app(), ["mask", str(src), str(tmp_path / "out.parquet")])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "out.parquet").equals(TabularMasker(POLICY, KEY).read_masked(src)[0])

"""tabular-classification from a CSV: masking keeps the kept columns' text as written (the masked
splits hold "07", not 7), and the step that makes tensors types them as pyarrow's CSV reader does,
so training sees exactly the features and labels of a typed read of the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from securetrain.audit.recorder import NullAuditRecorder
from securetrain.masking.tabular import TabularMasker, generate_finance_table
from securetrain.masking.tabular.csvtext import is_csv_text
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.tasks.base import TaskContext
from securetrain.pipeline.tasks.tabular import TabularClassification

from .pipeline_fixtures import ROOT, finance_config

KEY = bytes(range(32))


def _csv_text(table: pa.Table) -> pa.Table:
    """The table as an export writes it: hours zero-padded, amounts with two decimals, the label
    as a float ("1.0", as pandas writes an integer column that had a gap)."""
    rng = np.random.default_rng(5)
    owner = pa.array(rng.integers(0, 60, table.num_rows))  # customers with several transactions
    for name in ("customer_name", "customer_id", "iban", "card_number", "ssn", "email", "phone"):
        table = table.set_column(table.column_names.index(name), name, pc.take(table.column(name), owner))
    cols = {name: pc.cast(table.column(name), pa.string()) for name in table.column_names}
    cols["hour"] = pa.array([f"{h:02d}" for h in table.column("hour").to_pylist()])
    cols["amount"] = pa.array([f"{a:.2f}" for a in table.column("amount").to_pylist()])
    cols["label"] = pa.array([f"{y}.0" for y in table.column("label").to_pylist()])
    return pa.table(cols)


def _run(tmp: Path, source: Path) -> tuple[object, object]:
    config = load_pipeline_config(data=finance_config(tmp, data={"source": str(source)}, he={"enabled": False}))
    ctx = TaskContext(config, None, NullAuditRecorder())  # type: ignore[arg-type]  # key from the env
    task = TabularClassification()
    summary = task.prepare(ctx, source)
    return summary, task.build_datasets(ctx)


def test_csv_source_trains_on_the_typed_values_and_keeps_the_text(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_MASK_KEY", KEY.hex())
    csv = tmp_path / "transactions.csv"
    pacsv.write_csv(_csv_text(generate_finance_table(300, seed=3)), csv)
    # What training saw before masking kept the text: pyarrow's typed read of the same file.
    masker = TabularMasker(ROOT / "policies" / "finance-pii.yaml", KEY)
    text_rule = masker.string_columns(csv.read_text().splitlines()[0].replace('"', "").split(","))
    typed = pacsv.read_csv(csv, convert_options=pacsv.ConvertOptions(
        column_types={c: pa.string() for c in text_rule}, strings_can_be_null=False))
    assert typed.schema.field("hour").type == pa.int64() and typed.schema.field("label").type == pa.float64()
    pq.write_table(typed, tmp_path / "typed.parquet")

    summary, data = _run(tmp_path / "a", csv)
    typed_summary, typed_data = _run(tmp_path / "b", tmp_path / "typed.parquet")

    assert summary.class_names == typed_summary.class_names == ["0", "1"]  # 1.0 is class "1", as before
    assert summary.train_class_counts == typed_summary.train_class_counts
    assert summary.feature_columns == typed_summary.feature_columns
    assert data.class_names == typed_data.class_names
    for split in ("train", "eval"):
        ours, theirs = getattr(data, split), getattr(typed_data, split)
        assert torch.equal(ours.features, theirs.features), split  # hour and amount are numbers
        assert torch.equal(ours.labels, theirs.labels), split
    # The masked splits hold the file's text for kept columns, marked as CSV text.
    train = pq.read_table(tmp_path / "a" / "runs" / "fin" / "data" / "train.parquet")
    assert is_csv_text(train.schema.field("hour")) and train.schema.field("hour").type == pa.string()
    assert "07" in train.column("hour").to_pylist() or "03" in train.column("hour").to_pylist()
    assert all(len(h) == 2 for h in train.column("hour").to_pylist())
    assert all(v.endswith(".0") for v in train.column("label").to_pylist())

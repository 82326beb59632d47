"""Pinned output: optimisations of the masker must not change a single output value for the same key.

The digest covers the schema and every value (not the file bytes, which depend on the pyarrow
version's writer metadata) of a fixed synthetic table with a scanned free-text column holding the
row's own name and id. If this fails after a deliberate format change, bump the policy/token
version and re-pin; otherwise the change broke joinability of existing masked data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import KeepRule, load_policy
from securetrain.masking.tabular.synthetic import generate_finance_table

POLICY = Path(__file__).resolve().parents[2] / "policies" / "finance-pii.yaml"
# Pinned from the masker before the tabular performance work of issue 13 (main at 75658d2).
GOLDEN = "2a20d3a6ede2b4ae596803617d615fb183b520a51b2ada4363c4acf955cec1f6"


def _table() -> pa.Table:
    t = generate_finance_table(300, seed=7)
    rng = np.random.default_rng(3)
    memo = pc.binary_join_element_wise("transfer to ", t.column("customer_name"), " ref ", t.column("customer_id"), "")
    plain = pa.array(np.array(["standing order", "card payment", "salary", "refund"])[rng.integers(0, 4, len(t))])
    return t.append_column("memo", pc.if_else(pa.array(rng.random(len(t)) < 0.5), memo, plain))


def test_masked_output_is_pinned() -> None:
    policy = load_policy(POLICY)
    policy = policy.model_copy(update={"columns": [*policy.columns, KeepRule(name="memo", action="keep")]})
    table = _table()
    out = TabularMasker(policy, bytes(range(32))).mask_table(table)
    memo = out.column("memo").to_pylist()
    # The pin is only meaningful if the free text was really scrubbed of the row's identifiers.
    assert "transfer to [CUSTOMER_NAME] ref [CUSTOMER_ID]" in memo
    assert not set(table.column("customer_name").to_pylist()) & {m.split(" ref ")[0][12:] for m in memo}
    doc = json.dumps({"schema": [f"{f.name}:{f.type}" for f in out.schema], "columns": out.to_pydict()},
                     default=str, sort_keys=True)
    assert hashlib.sha256(doc.encode()).hexdigest() == GOLDEN


def test_masked_output_is_pinned_with_native_macs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pin when every tokenised column's MACs come from the native (DataFusion) path."""
    pytest.importorskip("datafusion")
    from securetrain.masking.tabular import hmac_native, transforms

    monkeypatch.setattr(hmac_native, "MIN_VALUES", 1)  # the 300-row table is below the usual threshold
    monkeypatch.delenv(hmac_native.NATIVE_ENV, raising=False)
    native_calls: list[bool] = []

    def spy(values: pa.Array, key: bytes, prefix: bytes) -> bytes | None:
        macs = hmac_native.native_macs(values, key, prefix)
        native_calls.append(macs is not None)
        return macs

    monkeypatch.setattr(transforms, "native_macs", spy)
    test_masked_output_is_pinned()
    assert native_calls and all(native_calls)  # every column's MACs were native, none fell back

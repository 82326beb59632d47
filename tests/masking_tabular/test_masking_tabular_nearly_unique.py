"""Columns whose values are (almost) all distinct are transformed row by row instead of through a
dictionary: the output, the invalid counts and the reported distinct counts are the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from securetrain.masking.tabular import transforms as T
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy
from securetrain.masking.tabular.synthetic import generate_finance_table

POLICY = Path(__file__).resolve().parents[2] / "policies" / "finance-pii.yaml"
KEY = bytes(range(32))


def _table() -> pa.Table:
    t = generate_finance_table(40_000, seed=21)
    rng = np.random.default_rng(2)
    # 5 % of the rows repeat another row's identifiers (still "nearly unique"), a few are invalid.
    dup = rng.random(len(t)) < 0.05
    src = np.where(dup, rng.integers(0, len(t), len(t)), np.arange(len(t)))
    for name in ("customer_id", "iban", "email", "phone", "card_number"):
        col = t.column(name).take(pa.array(src)).to_pylist()
        for i in rng.integers(0, len(t), 40).tolist():
            col[i] = {"email": "not-an-email", "phone": "12", "card_number": "4111 1111 1111 1112"}.get(name, col[i])
        t = t.set_column(t.column_names.index(name), name, pa.array(col, pa.string()))
    return t


def test_row_by_row_equals_the_dictionary_path(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy(POLICY)
    table = _table()
    taken: list[int | None] = []
    real = T._nearly_unique

    def spy(arr: pa.Array) -> int | None:
        taken.append(real(arr))
        return taken[-1]

    monkeypatch.setattr(T, "_nearly_unique", spy)
    rows_out, rows_rep = TabularMasker(policy, KEY).mask_table_with_report(table)
    assert sum(d is not None for d in taken) >= 4  # id, IBAN, e-mail, phone (and the card) went row by row
    monkeypatch.setattr(T, "NEARLY_UNIQUE", 2.0)  # never: everything through a dictionary
    taken.clear()
    dict_out, dict_rep = TabularMasker(policy, KEY).mask_table_with_report(table)
    assert taken and all(d is None for d in taken)
    assert rows_out.equals(dict_out)
    assert rows_rep.to_dict() == dict_rep.to_dict()
    by_col = {c.column: c for c in rows_rep.columns}
    assert by_col["customer_id"].distinct == len(set(table.column("customer_id").to_pylist())) < len(table)
    assert by_col["email"].invalid >= 1 and by_col["phone"].invalid >= 1


def test_probe_and_nulls_send_columns_to_the_dictionary() -> None:
    n = 4 * T.UNIQUE_PROBE
    assert T._nearly_unique(pa.array([f"v{i}" for i in range(n)])) == n
    assert T._nearly_unique(pa.array([f"v{i % 100}" for i in range(n)])) is None  # repeats: probe says no
    late_repeats = pa.array([f"v{i}" for i in range(T.UNIQUE_PROBE)] + ["same"] * (n - T.UNIQUE_PROBE))
    assert T._nearly_unique(late_repeats) is None  # the probe passes, the whole column decides
    assert T._nearly_unique(pa.array([f"v{i}" for i in range(n - 1)] + [None])) is None
    assert T._nearly_unique(pa.array([f"v{i}" for i in range(n - 1)])) is None  # too short


def test_transaction_shaped_columns_stop_at_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 rows per customer in random order: the leading values are mostly distinct (about 92 % at
    # 500k rows), but fewer than a nearly-unique column's would be: no full count is made.
    rng = np.random.default_rng(5)
    n = 200_000
    arr = pa.array([f"C{i:07d}" for i in rng.integers(0, n // 10, n)])
    full_counts: list[int] = []
    real_unique = T.pc.unique

    def counting_unique(values: pa.Array) -> pa.Array:
        if len(values) == n:
            full_counts.append(n)
        return real_unique(values)

    monkeypatch.setattr(T.pc, "unique", counting_unique)
    assert T._nearly_unique(arr) is None and not full_counts
    assert T._nearly_unique(pa.array([f"C{i:07d}" for i in range(n)])) == n and full_counts == [n]

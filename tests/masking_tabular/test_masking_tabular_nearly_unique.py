"""Columns whose values are (almost) all distinct are transformed row by row instead of through a
dictionary: the output, the invalid counts and the reported distinct counts are the same (the
distinct count then comes from the MACs, not from hashing the strings again)."""

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
    taken: list[bool] = []
    real = T._probably_unique

    def spy(arr: pa.Array) -> bool:
        taken.append(real(arr))
        return taken[-1]

    monkeypatch.setattr(T, "_probably_unique", spy)
    rows_out, rows_rep = TabularMasker(policy, KEY).mask_table_with_report(table)
    assert sum(taken) >= 4  # id, IBAN, e-mail, phone (and the card) went row by row
    monkeypatch.setattr(T, "_probably_unique", lambda arr: taken.append(False) or False)  # all by dictionary
    taken.clear()
    dict_out, dict_rep = TabularMasker(policy, KEY).mask_table_with_report(table)
    assert taken and not any(taken)
    assert rows_out.equals(dict_out)
    assert rows_rep.to_dict() == dict_rep.to_dict()
    by_col = {c.column: c for c in rows_rep.columns}
    assert by_col["customer_id"].distinct == len(set(table.column("customer_id").to_pylist())) < len(table)
    assert by_col["email"].invalid >= 1 and by_col["phone"].invalid >= 1


def test_probe_and_nulls_send_columns_to_the_dictionary() -> None:
    n = 4 * T.UNIQUE_PROBE
    assert T._probably_unique(pa.array([f"v{i}" for i in range(n)]))
    assert not T._probably_unique(pa.array([f"v{i % 100}" for i in range(n)]))  # repeats: probe says no
    assert not T._probably_unique(pa.array([f"v{i}" for i in range(n - 1)] + [None]))
    assert not T._probably_unique(pa.array([f"v{i}" for i in range(n - 1)]))  # too short


def test_late_repeats_go_row_by_row_with_the_exact_distinct_count() -> None:
    # The probe passes, the rest of the column repeats: computed row by row (same tokens as the
    # dictionary path) and the reported distinct count is still exact.
    n = 4 * T.UNIQUE_PROBE
    values = [f"v{i}" for i in range(T.UNIQUE_PROBE)] + [f"same{i % 7}" for i in range(n - T.UNIQUE_PROBE)]
    assert T._probably_unique(pa.array(values))
    stats = T.ColumnStats()
    rows = T.tokenize(pa.array(values), KEY, domain="d", prefix="tok_", length=16, stats=stats)
    assert stats.distinct == len(set(values)) == T.UNIQUE_PROBE + 7
    assert rows.to_pylist() == T.tokens_for(values, KEY, domain="d", prefix="tok_", length=16).to_pylist()


def test_distinct_count_from_macs() -> None:
    key = bytes(32)
    for values in ([], ["a"], ["a", "a"], ["a", "b", "a", "c", "b"], [f"x{i % 1000}" for i in range(5000)]):
        macs = T._macs(pa.array(values, pa.string()), key, "d")
        assert T.distinct_macs(macs) == len(set(values))


def test_transaction_shaped_columns_stop_at_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 rows per customer in random order: the leading values are mostly distinct (about 92 % at
    # 500k rows), but fewer than a nearly-unique column's would be. No pass over the whole column
    # counts distinct strings, for either kind of column.
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
    assert not T._probably_unique(arr)
    unique = pa.array([f"C{i:07d}" for i in range(n)])
    assert T._probably_unique(unique)
    stats = T.ColumnStats()
    T.tokenize(unique, KEY, domain="d", prefix="t", length=8, stats=stats)
    assert stats.distinct == n and not full_counts


def _dictionary_encoded(path: Path) -> dict[str, bool]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    out: dict[str, bool] = {}
    for rg in range(meta.num_row_groups):
        for i in range(meta.num_columns):
            chunk = meta.row_group(rg).column(i)
            out[chunk.path_in_schema] = out.get(chunk.path_in_schema, False) or chunk.has_dictionary_page
    return out


def test_masked_token_columns_are_written_without_a_dictionary(tmp_path: Path) -> None:
    from securetrain.masking.tabular.tableio import parse_table, read_bytes, write_table

    table = generate_finance_table(5000, seed=3)
    src, dst = tmp_path / "in.parquet", tmp_path / "out.parquet"
    write_table(table, src)
    masker = TabularMasker(load_policy(POLICY), KEY)
    report = masker.mask_file(src, dst)
    encoded = _dictionary_encoded(dst)
    by_col = {c.column: c for c in report.columns}
    # One token per customer id: no dictionary; the repeating categories keep theirs.
    assert by_col["customer_id"].distinct == len(set(table.column("customer_id").to_pylist()))
    assert encoded["customer_id"] is False and encoded["email"] is False
    assert encoded["category"] is True
    # The file holds exactly the masked table.
    assert parse_table(read_bytes(dst)[0], "parquet", name="out").equals(masker.mask_table(table))

"""Columns masked on a thread pool: the same output, reports and refusals as one column at a time,
the first failing column in table order is the one reported, progress in table order."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from securetrain.masking.tabular import detectors as D
from securetrain.masking.tabular import masker as masker_mod
from securetrain.masking.tabular.errors import MalformedTableError, PIIDetectedError, TabularMaskingError
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import KeepRule, load_policy
from securetrain.masking.tabular.synthetic import generate_finance_table

POLICY = Path(__file__).resolve().parents[2] / "policies" / "finance-pii.yaml"
KEY = bytes(range(32))


@pytest.fixture(autouse=True)
def _pool_for_small_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(masker_mod, "PARALLEL_MIN_ROWS", 0)
    monkeypatch.delenv(masker_mod.THREADS_ENV, raising=False)


def _memo_table(rows: int) -> tuple[pa.Table, object]:
    t = generate_finance_table(rows, seed=9)
    memo = pc.binary_join_element_wise("transfer to ", t.column("customer_name"), " ref ", t.column("customer_id"), "")
    policy = load_policy(POLICY)
    policy = policy.model_copy(update={"columns": [*policy.columns, KeepRule(name="memo", action="keep")]})
    return t.append_column("memo", memo), policy


def test_threaded_output_and_report_equal_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    table, policy = _memo_table(600)
    used: set[str] = set()
    real_apply = TabularMasker._apply

    def spy(self: TabularMasker, *args: object, **kwargs: object) -> object:
        used.add(threading.current_thread().name)
        return real_apply(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TabularMasker, "_apply", spy)
    # The memo column's same-row scrub in row shares too (3 shares of 200 rows).
    shares: list[int] = []
    real_scrub = D._scrub_rows

    def scrub_spy(text: pa.Array, *args: object, **kwargs: object) -> object:
        shares.append(len(text))
        return real_scrub(text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(D, "SCRUB_SHARE_MIN_ROWS", 200)
    monkeypatch.setattr(D, "_scrub_rows", scrub_spy)
    monkeypatch.setenv(masker_mod.THREADS_ENV, "3")
    seen: list[str] = []
    threaded, rep_threaded = TabularMasker(policy, KEY).mask_table_with_report(table, on_column=seen.append)
    assert seen == table.column_names  # progress in table order
    assert any(n.startswith("securetrain-mask") for n in used)  # really ran on the pool
    assert [200, 200, 200] in [shares[i:i + 3] for i in range(len(shares))]  # the memo column, in shares
    used.clear()
    monkeypatch.setenv(masker_mod.THREADS_ENV, "1")
    serial, rep_serial = TabularMasker(policy, KEY).mask_table_with_report(table)
    assert used == {threading.current_thread().name}
    assert threaded.equals(serial, check_metadata=True)
    assert rep_threaded.to_dict() == rep_serial.to_dict()
    assert "transfer to [CUSTOMER_NAME] ref [CUSTOMER_ID]" in threaded.column("memo").to_pylist()


def test_first_failing_column_in_table_order_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    p = load_policy(data={"policy_version": "1", "default": {"action": "keep"}, "columns": [
        {"name": "d", "action": "generalize", "granularity": "month"},
        {"name": "id", "action": "tokenize"}]})
    bad_date = pa.table({"comment": ["ok"] * 3, "d": ["2020-01-01", "John Secretname", "2020-02-02"],
                         "id": ["a", "b", "c"], "later": ["ssn 123-45-6789", "x", "y"]})
    for threads in ("1", "2"):
        monkeypatch.setenv(masker_mod.THREADS_ENV, threads)
        # 'd' (a transform job) fails before 'later' (a kept column, scanned in the other job).
        with pytest.raises(MalformedTableError, match="'d'") as info:
            TabularMasker(p, KEY).mask_table(bad_date)
        assert "Secretname" not in str(info.value)
        # A kept column before a failing transform: the kept column's refusal is reported.
        first_kept = bad_date.select(["later", "d", "id", "comment"])
        with pytest.raises(PIIDetectedError, match="ssn"):
            TabularMasker(p, KEY).mask_table(first_kept)


def test_thread_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(masker_mod.THREADS_ENV, "4")
    assert masker_mod.column_threads() == 4
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv(masker_mod.THREADS_ENV, bad)
        with pytest.raises(TabularMaskingError, match=masker_mod.THREADS_ENV):
            TabularMasker(load_policy(POLICY), KEY).mask_table(generate_finance_table(50, seed=1))
    monkeypatch.delenv(masker_mod.THREADS_ENV)
    assert 1 <= masker_mod.column_threads() <= 2
    # By default, two threads only while two CPUs are free of other work.
    monkeypatch.setattr(masker_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for others, threads in ((0, 2), (1, 1), (5, 1)):
        monkeypatch.setattr(masker_mod, "_other_runnable_tasks", lambda n=others: n)
        assert masker_mod.column_threads() == threads
    monkeypatch.setattr(masker_mod.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert masker_mod.column_threads() == 2  # never more than 2 by default
    monkeypatch.setenv(masker_mod.THREADS_ENV, "2")
    assert masker_mod.column_threads() == 2  # an explicit count is taken as given


def test_other_runnable_tasks_reads_the_run_queue(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    real_open = builtins.open
    fake = tmp_path / "loadavg"

    def fake_open(path: object, *args: object, **kwargs: object) -> object:
        return real_open(fake if path == "/proc/loadavg" else path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", fake_open)
    fake.write_text("2.32 2.26 1.92 3/152 27364\n")
    assert masker_mod._other_runnable_tasks() == 2  # 3 runnable, one of them the caller
    fake.write_text("0.10 0.20 0.30 1/152 27364\n")
    assert masker_mod._other_runnable_tasks() == 0
    fake.write_text("garbage")
    assert masker_mod._other_runnable_tasks() == 0

"""HMACs of a large column computed natively (DataFusion): identical to hmac.digest for every kind
of value and array, used only above the threshold, and falling back to hashlib (returning None)
whenever the native answer is unavailable or not trusted."""

from __future__ import annotations

import hmac
import logging
import os

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("datafusion")

from securetrain.masking.tabular import hmac_native, transforms  # noqa: E402
from securetrain.masking.tabular.masker import TabularMasker  # noqa: E402
from securetrain.masking.tabular.policy import load_policy  # noqa: E402
from securetrain.masking.tabular.synthetic import generate_finance_table  # noqa: E402

KEY = bytes(range(32))
PREFIX = b"customer\x00"


@pytest.fixture(autouse=True)
def _native_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hmac_native.NATIVE_ENV, raising=False)


def _values(n: int) -> pa.Array:
    # Multi-byte UTF-8, empty values, values longer than a SHA-256 block and than 2 KiB; sliced,
    # so the array has an offset.
    vals = [f"C{i:07d}" if i % 7 else ("é中" * (i % 5)) for i in range(n + 3)]
    vals[10] = "x" * 100
    vals[11] = "y" * 3000
    return pa.array(vals).slice(3)


def _reference(values: pa.Array, key: bytes = KEY, prefix: bytes = PREFIX) -> bytes:
    return b"".join(hmac.digest(key, prefix + (v if isinstance(v, bytes) else v.encode()), "sha256")
                    for v in values.to_pylist())


def test_native_macs_equal_hmac_digest() -> None:
    values = _values(5000)
    assert hmac_native.native_macs(values, KEY, PREFIX) == _reference(values)
    for typ in (pa.large_string(), pa.binary(), pa.large_binary()):
        assert hmac_native.native_macs(values.cast(typ), KEY, PREFIX) == _reference(values)
    long_key = bytes(range(100))  # longer than the block: hashed first (RFC 2104)
    assert hmac_native.native_macs(values, long_key, b"") == _reference(values, long_key, b"")


def test_many_partitions_keep_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values(20_000)
    monkeypatch.setattr(hmac_native, "CHUNK_VALUES", 1500)
    parts = hmac_native._partitions(values, len(PREFIX))
    assert len(parts) >= 14 and sum(len(p) for p in parts) == len(values)
    assert hmac_native.native_macs(values, KEY, PREFIX) == _reference(values)
    # A byte budget smaller than one partition's values cuts partitions by size instead.
    monkeypatch.setattr(hmac_native, "CHUNK_BYTES", 40_000)
    parts = hmac_native._partitions(values, len(PREFIX))
    assert max(p.nbytes for p in parts) < 40_000 + 3100 and sum(len(p) for p in parts) == len(values)
    assert hmac_native.native_macs(values, KEY, PREFIX) == _reference(values)


def test_only_large_arrays_without_nulls_and_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hmac_native.native_macs(_values(hmac_native.MIN_VALUES - 1), KEY, PREFIX) is None
    assert hmac_native.native_macs(pa.array(["a", None] * 2000), KEY, PREFIX) is None
    values = _values(hmac_native.MIN_VALUES)
    assert hmac_native.native_macs(values, KEY, PREFIX) == _reference(values)
    monkeypatch.setenv(hmac_native.NATIVE_ENV, "0")
    assert hmac_native.native_macs(values, KEY, PREFIX) is None


def test_a_forked_process_does_not_use_the_parents_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values(2000)
    assert hmac_native.native_macs(values, KEY, PREFIX) is not None  # the runtime belongs to this pid
    monkeypatch.setattr(hmac_native, "_owner_pid", os.getpid() + 1)  # as seen from a forked child
    assert hmac_native.native_macs(values, KEY, PREFIX) is None


def test_a_wrong_answer_is_not_trusted(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    values = _values(3000)
    good = hmac_native.hmac_pads
    # Wrong pads for the native query only: every native MAC is wrong, the spot check must catch it.
    monkeypatch.setattr(hmac_native, "hmac_pads", lambda key: good(key[::-1]))
    with caplog.at_level(logging.WARNING):
        assert hmac_native.native_macs(values, KEY, PREFIX) is None
    assert "spot check" in caplog.text
    # Only one batch out of place: caught too (the first MAC of every result batch is checked).
    monkeypatch.setattr(hmac_native, "hmac_pads", good)
    real_concat = pa.concat_arrays

    def swapped(arrays: list[pa.Array]) -> pa.Array:
        arrays = list(arrays)
        if len(arrays) > 1:
            arrays[0], arrays[1] = arrays[1], arrays[0]
        return real_concat(arrays)

    monkeypatch.setattr(hmac_native.pa, "concat_arrays", swapped)
    monkeypatch.setattr(hmac_native, "CHUNK_VALUES", 1024)
    assert hmac_native.native_macs(values, KEY, PREFIX) is None


def test_a_failing_query_falls_back_without_quoting_it(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    datafusion = hmac_native._datafusion()
    ipad, _ = hmac_native.hmac_pads(KEY)

    class Boom:
        def __init__(self, *args: object) -> None:
            # DataFusion's errors can quote a query's literals (the padded key): never logged.
            raise RuntimeError(f"cannot plan literal {ipad.hex()}")

    monkeypatch.setattr(datafusion, "SessionContext", Boom)
    values = _values(2000)
    with caplog.at_level(logging.DEBUG):
        assert hmac_native.native_macs(values, KEY, PREFIX) is None
        tokens = transforms.tokens_for_array(values, KEY, domain="customer", prefix="c_", length=16)
    assert "RuntimeError" in caplog.text and ipad.hex() not in caplog.text
    monkeypatch.undo()
    assert transforms.tokens_for_array(values, KEY, domain="customer", prefix="c_", length=16).equals(tokens)


def test_masked_table_is_the_same_with_and_without_native_macs(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy(os.path.join(os.path.dirname(__file__), "..", "..", "policies", "finance-pii.yaml"))
    table = generate_finance_table(3000, seed=5)
    calls: list[bool] = []
    real = hmac_native.native_macs

    def spy(values: pa.Array, key: bytes, prefix: bytes) -> bytes | None:
        macs = real(values, key, prefix)
        calls.append(macs is not None)
        return macs

    monkeypatch.setattr(transforms, "native_macs", spy)
    native = TabularMasker(policy, KEY).mask_table(table)
    assert sum(calls) >= 3  # the unique-per-row columns (ids, IBANs, e-mails...) went native
    monkeypatch.setenv(hmac_native.NATIVE_ENV, "0")
    calls.clear()
    plain = TabularMasker(policy, KEY).mask_table(table)
    assert calls and not any(calls)
    assert native.equals(plain)
    assert len(np.unique(native.column("customer_id").to_numpy(zero_copy_only=False))) == 3000

"""HMACs of large columns shared with helper processes: identical to the serial MACs, used only
above the threshold, and falling back to this process when a helper fails."""

from __future__ import annotations

import hmac
import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from securetrain.masking.tabular import hmac_pool
from securetrain.masking.tabular.errors import TabularMaskingError
from securetrain.masking.tabular.hmac_batch import HEADER, HmacSha256, serve
from securetrain.masking.tabular.masker import TabularMasker
from securetrain.masking.tabular.policy import load_policy

KEY = bytes(range(32))
PREFIX = b"customer\x00"


@pytest.fixture(autouse=True)
def _small_shares(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Shares of 50 values, so the parallel path runs on small arrays; no helper outlives a test."""
    monkeypatch.setattr(hmac_pool, "MIN_SHARE", 50)
    monkeypatch.delenv(hmac_pool.WORKERS_ENV, raising=False)
    hmac_pool.close_helpers()
    yield
    hmac_pool.close_helpers()


def _values(n: int) -> pa.Array:
    # Multi-byte UTF-8, empty and long values; sliced, so the array has an offset.
    vals = [f"C{i:07d}" if i % 7 else ("é中" * (i % 5)) for i in range(n + 3)]
    return pa.array(vals).slice(3)


def _reference(values: pa.Array) -> bytes:
    return b"".join(hmac.digest(KEY, PREFIX + v.encode(), "sha256") for v in values.to_pylist())


@pytest.mark.parametrize("workers", [1, 3])
def test_shared_macs_equal_the_serial_ones(workers: int) -> None:
    values = _values(1000)
    serial = hmac_pool.hmac_many(values, KEY, PREFIX, workers=0)
    assert not hmac_pool.helper_pids()  # workers=0: nothing started
    shared = hmac_pool.hmac_many(values, KEY, PREFIX, workers=workers)
    assert len(hmac_pool.helper_pids()) == workers
    assert shared == serial == _reference(values)
    # The helpers are kept and reused for the next column.
    pids = hmac_pool.helper_pids()
    assert hmac_pool.hmac_many(values, KEY, b"other\x00", workers=workers) == \
        HmacSha256(KEY).with_prefix(b"other\x00").many(values.cast(pa.binary()).to_pylist())
    assert hmac_pool.helper_pids() == pids


def test_large_string_and_binary_values() -> None:
    values = _values(300)
    for typ in (pa.large_string(), pa.binary(), pa.large_binary()):
        assert hmac_pool.hmac_many(values.cast(typ), KEY, PREFIX, workers=2) == _reference(values)


def test_threshold_switch() -> None:
    # Below two shares' worth of values everything is computed here, whatever the worker count.
    assert hmac_pool.plan_shares(99, 4) == [(0, 99)]
    assert hmac_pool.plan_shares(100, 4) == [(0, 50), (50, 100)]
    assert hmac_pool.plan_shares(1000, 0) == [(0, 1000)]
    shares = hmac_pool.plan_shares(1001, 3)
    assert len(shares) == 4 and shares[0][0] == 0 and shares[-1][1] == 1001
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    values = _values(99)
    assert hmac_pool.hmac_many(values, KEY, PREFIX, workers=4) == _reference(values)
    assert not hmac_pool.helper_pids()


def test_worker_count_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hmac_pool.os, "getloadavg", lambda: (1.0, 1.0, 1.0))  # only this process runs
    monkeypatch.setattr(hmac_pool.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert hmac_pool.configured_workers() == 3
    monkeypatch.setattr(hmac_pool.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert hmac_pool.configured_workers() == hmac_pool.MAX_AUTO_WORKERS
    monkeypatch.setattr(hmac_pool.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert hmac_pool.configured_workers() == 0
    monkeypatch.setenv(hmac_pool.WORKERS_ENV, "2")
    assert hmac_pool.configured_workers() == 2
    monkeypatch.setenv(hmac_pool.WORKERS_ENV, "0")
    assert hmac_pool.configured_workers() == 0
    values = _values(500)
    assert hmac_pool.hmac_many(values, KEY, PREFIX) == _reference(values)
    assert not hmac_pool.helper_pids()
    for bad in ("many", "-1"):
        monkeypatch.setenv(hmac_pool.WORKERS_ENV, bad)
        with pytest.raises(TabularMaskingError, match=hmac_pool.WORKERS_ENV):
            hmac_pool.configured_workers()


def test_automatic_count_leaves_busy_cpus_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hmac_pool.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    for load, expected in [(0.2, 3), (1.0, 3), (2.0, 2), (3.4, 1), (3.6, 0), (12.0, 0)]:
        monkeypatch.setattr(hmac_pool.os, "getloadavg", lambda load=load: (load, load, load))
        assert hmac_pool.configured_workers() == expected, load
    # This process's own running helpers are part of the load: they do not switch themselves off.
    monkeypatch.setattr(hmac_pool.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    hmac_pool.hmac_many(_values(400), KEY, PREFIX, workers=2)
    monkeypatch.setattr(hmac_pool.os, "getloadavg", lambda: (4.0, 4.0, 4.0))  # us + 2 helpers + 1 other
    assert hmac_pool.configured_workers() == 2
    monkeypatch.setenv(hmac_pool.WORKERS_ENV, "3")  # an explicit count is taken as given
    monkeypatch.setattr(hmac_pool.os, "getloadavg", lambda: (12.0, 12.0, 12.0))
    assert hmac_pool.configured_workers() == 3


def _policy() -> object:
    return load_policy(data={"policy_version": "1", "columns": [
        {"name": "id", "action": "tokenize", "domain": "customer"},
        {"name": "mail", "action": "email"},
        {"name": "phone", "action": "phone", "keep_last": 2},
        {"name": "pan", "action": "pan", "mode": "tokenize_last4"},
    ]})


def test_masker_output_is_the_same_with_and_without_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 400
    rng = np.random.default_rng(5)
    table = pa.table({
        "id": [f" c{i} " for i in rng.integers(0, 10**9, n)],
        "mail": [f"User{i}@Example.com" for i in range(n)],
        "phone": [f"+44 20 {i:04d} {i % 97:04d}" for i in range(n)],
        "pan": ["4111 1111 1111 1111" if i % 3 else "4012888888881881" for i in range(n)],
    })
    masker = TabularMasker(_policy(), KEY)
    monkeypatch.setenv(hmac_pool.WORKERS_ENV, "0")
    serial = masker.mask_table(table)
    assert not hmac_pool.helper_pids()
    monkeypatch.setenv(hmac_pool.WORKERS_ENV, "2")
    shared = masker.mask_table(table)
    assert hmac_pool.helper_pids()
    assert shared.equals(serial)


def test_bad_worker_setting_refuses_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hmac_pool.WORKERS_ENV, "lots")
    table = pa.table({"id": [f"c{i}" for i in range(200)], "mail": ["a@b.cd"] * 200,
                      "phone": ["+4420123456"] * 200, "pan": ["4111111111111111"] * 200})
    with pytest.raises(TabularMaskingError, match=hmac_pool.WORKERS_ENV):
        TabularMasker(_policy(), KEY).mask_table(table)


@pytest.mark.parametrize("script", [
    "import sys\nsys.exit(0)\n",  # dies before answering
    "import sys\ndata = sys.stdin.buffer.read(64)\nsys.stdout.buffer.write(bytes(10**6))\n",  # wrong answer
])
def test_a_failing_helper_falls_back_to_this_process(script: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    helper = tmp_path / "helper.py"
    helper.write_text(script)
    monkeypatch.setattr(hmac_pool, "_HELPER_SCRIPT", helper)
    values = _values(600)
    with caplog.at_level(logging.WARNING, logger=hmac_pool.__name__):
        assert hmac_pool.hmac_many(values, KEY, PREFIX, workers=2) == _reference(values)
    assert "failed" in caplog.text
    assert "C000" not in caplog.text  # no values in the log
    assert not hmac_pool.helper_pids()  # the bad helpers were stopped


def test_helper_that_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hmac_pool.sys, "executable", "/nonexistent/python")
    values = _values(300)
    assert hmac_pool.hmac_many(values, KEY, PREFIX, workers=2) == _reference(values)
    assert not hmac_pool.helper_pids()


def test_a_forked_child_starts_its_own_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values(300)
    hmac_pool.hmac_many(values, KEY, PREFIX, workers=1)
    parent = hmac_pool._the_pool()
    parent_helpers = list(parent.helpers)
    monkeypatch.setattr(parent, "pid", -1)  # as if this process were a fork of the pool's owner
    assert hmac_pool.helper_pids() == []
    assert hmac_pool._the_pool() is not parent
    assert hmac_pool.hmac_many(values, KEY, PREFIX, workers=1) == _reference(values)
    assert all(h.proc.poll() is None for h in parent_helpers)  # the "parent's" helpers untouched
    for h in parent_helpers:
        h.close()


def test_helper_protocol_in_process() -> None:
    msgs = [b"", b"a", "é中".encode(), b"x" * 300]
    offsets = np.cumsum([0] + [len(m) for m in msgs]).astype(np.uint64)
    request = io.BytesIO()
    for prefix in (b"d\x00", b""):
        request.write(HEADER.pack(len(KEY), len(prefix), len(msgs), offsets[-1]) + KEY + prefix
                      + offsets.tobytes() + b"".join(msgs))
    request.seek(0)
    out = io.BytesIO()
    serve(request, out)
    expected = [hmac.digest(KEY, p + m, "sha256") for p in (b"d\x00", b"") for m in msgs]
    assert out.getvalue() == b"".join(expected)
    with pytest.raises(EOFError):
        serve(io.BytesIO(HEADER.pack(32, 0, 1, 5) + KEY), io.BytesIO())


def test_helper_runs_isolated_from_the_environment() -> None:
    # The helper is started with -I: it must run from the standard library alone.
    assert hmac_pool._HELPER_SCRIPT.name == "hmac_batch.py"
    source = hmac_pool._HELPER_SCRIPT.read_text()
    imports = {line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert all(name.split(".")[0] in sys.stdlib_module_names or name == "__future__" for name in imports)

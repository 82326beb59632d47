"""The per-distinct-value HMACs of a large column, shared between this process and helper processes.

hashlib holds the GIL while it hashes messages shorter than 2 KiB, so threads cannot compute the
MACs of identifiers in parallel; separate processes can. Above :data:`MIN_SHARE` values per
process, the values are cut into contiguous shares: this process computes the first, each helper
one of the others, and the MACs are concatenated in order, so the tokens are byte-identical to a
serial run whatever the number of helpers (a test checks it).

The helpers are ``python -I hmac_batch.py`` (standard library only, isolated mode, started with
``subprocess``: no fork of this process, no re-import of the caller's main script). They are
started on first use, kept for the life of the process and closed at exit. Each job sends the
derived tokenisation key (never the project key) and the values down an anonymous pipe to a child
of this process; the helper keeps nothing between jobs and writes nothing but the MACs. Any failure
(a helper that cannot start, dies or answers wrongly) falls back to computing that share here;
the first MAC of every helper's share is checked against one computed here.

``SECURETRAIN_TABULAR_HMAC_WORKERS`` sets the number of helpers (0: never use any); by default it
is the number of CPUs this process may run on, minus one, at most :data:`MAX_AUTO_WORKERS`.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa

from securetrain.cpus import usable_cpus
from securetrain.masking.tabular import hmac_batch
from securetrain.masking.tabular.arrow_buffers import offsets_and_data
from securetrain.masking.tabular.errors import TabularMaskingError
from securetrain.masking.tabular.hmac_batch import HEADER, MAC_BYTES, HmacSha256

WORKERS_ENV = "SECURETRAIN_TABULAR_HMAC_WORKERS"
MAX_AUTO_WORKERS = 7
# Values per process below which a helper does not pay off: 10k MACs are about 7-9 ms, the pipe
# transfer of their values and MACs well under 1 ms.
MIN_SHARE = 10_000
_HELPER_SCRIPT = Path(hmac_batch.__file__).resolve()
_log = logging.getLogger(__name__)


def configured_workers() -> int:
    """Helper processes to use for a large column: ``SECURETRAIN_TABULAR_HMAC_WORKERS``, or else
    usable CPUs - 1 (at most :data:`MAX_AUTO_WORKERS`), but no more than the CPUs the 1-minute
    load average leaves idle: on a busy machine a helper only competes with this process."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            workers = int(raw)
        except ValueError:
            workers = -1
        if workers < 0:
            raise TabularMaskingError(
                f"{WORKERS_ENV}={raw!r} is not a number of helper processes",
                hint="set it to 0 (no helpers) or a positive integer, or unset it for the default",
            )
        return workers
    if not sys.executable:  # embedded interpreter: nothing to start helpers with
        return 0
    cpus = usable_cpus()
    workers = max(0, min(cpus - 1, MAX_AUTO_WORKERS))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return workers
    # The load counts this process and, while a masking run keeps them busy, its own helpers.
    idle = cpus - load + len(helper_pids())
    return max(0, min(workers, int(idle + 0.5)))


def plan_shares(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) shares of ``n`` values: this process's first, then one per helper
    used (as many as keep every share at least :data:`MIN_SHARE` values, at most ``workers``)."""
    helpers = max(0, min(workers, n // MIN_SHARE - 1))
    bounds = [i * n // (helpers + 1) for i in range(helpers + 2)]
    return list(zip(bounds, bounds[1:]))


class _Helper:
    """One helper process and its pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(_HELPER_SCRIPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )

    def send(self, key: bytes, prefix: bytes, offsets: np.ndarray, data: np.ndarray) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(HEADER.pack(len(key), len(prefix), len(offsets) - 1, data.nbytes))
        stdin.write(key)
        stdin.write(prefix)
        stdin.write(np.ascontiguousarray(offsets, dtype=np.uint64).data)  # buffers, no copy
        stdin.write(np.ascontiguousarray(data).data)
        stdin.flush()

    def receive(self, n: int) -> bytes:
        stdout = self.proc.stdout
        assert stdout is not None
        macs = stdout.read(n * MAC_BYTES)
        if len(macs) != n * MAC_BYTES:
            raise EOFError("the HMAC helper process ended early")
        return macs

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Pool:
    """The helpers of this process (one job at a time; a second thread computes serially)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.helpers: list[_Helper] = []

    def ensure(self, count: int) -> list[_Helper]:
        """Up to ``count`` running helpers (fewer if some cannot be started)."""
        self.helpers = [h for h in self.helpers if h.proc.poll() is None]
        while len(self.helpers) < count:
            try:
                self.helpers.append(_Helper())
            except OSError as exc:
                _log.warning("cannot start an HMAC helper process (%s); computing tokens here",
                             type(exc).__name__)
                break
        return self.helpers[:count]

    def discard(self, helper: _Helper) -> None:
        if helper in self.helpers:
            self.helpers.remove(helper)
        helper.close()

    def close(self) -> None:
        for helper in self.helpers:
            helper.close()
        self.helpers = []


_pool: _Pool | None = None
_pool_guard = threading.Lock()


def _the_pool() -> _Pool:
    global _pool
    with _pool_guard:
        # After a fork the helpers' pipes belong to the parent: leave them alone, start new ones.
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()
        return _pool


@atexit.register
def close_helpers() -> None:
    """Stop this process's helper processes (they are restarted on the next large column)."""
    if _pool is not None and _pool.pid == os.getpid():
        with _pool.lock:
            _pool.close()


def helper_pids() -> list[int]:
    """Process ids of this process's running helpers (for CPU accounting in benchmarks)."""
    pool = _pool
    if pool is None or pool.pid != os.getpid():
        return []
    return [h.proc.pid for h in pool.helpers if h.proc.poll() is None]


def hmac_many(values: pa.Array, key: bytes, prefix: bytes, *, workers: int | None = None) -> bytes:
    """Concatenated HMAC-SHA256(key, prefix || value) of each value of a string or binary array
    without nulls, in order; shared with helper processes when it is large enough (``workers``:
    the most helpers to use, default :func:`configured_workers`)."""
    mac = HmacSha256(key).with_prefix(prefix)
    n = len(values)
    shares = plan_shares(n, configured_workers() if workers is None else workers)
    if len(shares) == 1:
        return mac.many(values.cast(pa.binary()).to_pylist())
    pool = _the_pool()
    if not pool.lock.acquire(blocking=False):  # another thread is using the helpers
        return mac.many(values.cast(pa.binary()).to_pylist())
    try:
        return _shared(values, mac, key, prefix, shares, pool)
    finally:
        pool.lock.release()


def _shared(values: pa.Array, mac: HmacSha256, key: bytes, prefix: bytes, shares: list[tuple[int, int]],
            pool: _Pool) -> bytes:
    offsets, data = offsets_and_data(values)

    def here(start: int, end: int) -> bytes:
        return mac.many(values.slice(start, end - start).cast(pa.binary()).to_pylist())

    helpers = pool.ensure(len(shares) - 1)
    pending: dict[int, _Helper] = {}  # share index -> helper computing it
    try:
        for i, (started, (start, end)) in enumerate(zip(helpers, shares[1:]), start=1):
            try:
                started.send(key, prefix, offsets[start:end + 1] - offsets[start], data[offsets[start]:offsets[end]])
                pending[i] = started
            except OSError:
                pool.discard(started)
        parts = [here(*shares[0])]  # this process's share, while the helpers compute theirs
        for i, (start, end) in enumerate(shares[1:], start=1):
            macs: bytes | None = None
            helper = pending.pop(i) if i in pending else None
            if helper is not None:
                try:
                    macs = helper.receive(end - start)
                except (OSError, EOFError):
                    pool.discard(helper)
                first = bytes(data[offsets[start]:offsets[start + 1]])
                if macs is not None and macs[:MAC_BYTES] != mac.many([first]):
                    pool.discard(helper)  # a wrong answer: never trust that helper again
                    macs = None
            if macs is None:
                _log.warning("an HMAC helper process failed; computing its share here")
                macs = here(start, end)
            parts.append(macs)
        return b"".join(parts)
    finally:
        # Interrupted with answers still in the pipes: those helpers are out of step, stop them.
        for helper in pending.values():
            pool.discard(helper)

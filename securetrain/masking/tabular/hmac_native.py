"""The HMAC-SHA256s of a large column in one native pass (Apache DataFusion's ``digest`` kernel).

HMAC-SHA256 is ``SHA256(K ^ opad || SHA256(K ^ ipad || message))`` (RFC 2104), where ``K`` is the
key zero-padded to the 64-byte block. DataFusion computes ``digest(concat(lit, column), 'sha256')``
over a whole Arrow array in Rust without a Python call per value, so the MACs of a column are two
such expressions: about 0.25 us per value against about 0.8-1 us for the per-value ``hashlib`` loop
of :class:`~securetrain.masking.tabular.hmac_batch.HmacSha256`. The result is byte-identical to
``hmac.digest(key, prefix + value, "sha256")`` (a test and a golden-token test check it).

Fail safe, never fail open: when DataFusion is not installed, this process was forked from one
that had used it (its runtime threads do not survive a fork), a query fails, the result has the
wrong shape, or any sampled MAC differs from the one computed with ``hashlib``, :func:`native_macs`
returns None and the caller computes the MACs with ``hashlib`` (a warning names only the error's
type: DataFusion's messages can quote a query's literals, which hold the padded key).

``SECURETRAIN_TABULAR_HMAC_NATIVE=0`` turns the native path off (e.g. to compare the two).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import pyarrow as pa

from securetrain.cpus import usable_cpus
from securetrain.masking.tabular.arrow_buffers import offsets_and_data
from securetrain.masking.tabular.hmac_batch import MAC_BYTES, HmacSha256, hmac_pads

NATIVE_ENV = "SECURETRAIN_TABULAR_HMAC_NATIVE"
# Below this many values the per-query overhead (~1 ms) is more than hashlib's loop costs.
MIN_VALUES = 1024
# Values per partition (and bytes of MAC input per partition, kept far below the 2 GiB that
# 32-bit Arrow offsets allow): partitions are computed by DataFusion's threads.
CHUNK_VALUES = 262_144
CHUNK_BYTES = 1 << 28
_log = logging.getLogger(__name__)

_state_lock = threading.Lock()
_module: Any = None  # the datafusion module, False when it cannot be imported
_owner_pid: int | None = None  # the process that first used DataFusion's runtime


def enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _datafusion() -> Any:
    """The datafusion module, or None (not installed, disabled, or unusable after a fork)."""
    global _module, _owner_pid
    if not enabled():
        return None
    with _state_lock:
        if _module is None:
            try:
                import datafusion
            except Exception:  # not installed or broken: the hashlib path serves
                _module = False
            else:
                _module = datafusion
                _owner_pid = os.getpid()
        if _module is False or _owner_pid != os.getpid():
            return None
        return _module


def _binary(values: pa.Array) -> pa.Array:
    """The values as ``binary`` (a zero-copy view of a ``string`` array)."""
    if pa.types.is_binary(values.type):
        return values
    if pa.types.is_string(values.type):
        return values.view(pa.binary())
    return values.cast(pa.binary())  # large types: a copy with 32-bit offsets (chunks keep it small)


def _partitions(values: pa.Array, prefix_len: int) -> list[pa.Array]:
    """Contiguous slices, one per thread for a mid-size column, each of at most CHUNK_VALUES
    values and CHUNK_BYTES bytes of MAC input."""
    n = len(values)
    target = max(MIN_VALUES, min(CHUNK_VALUES, -(-n // usable_cpus())))
    offs = offsets_and_data(values)[0]
    cuts = [0]
    while cuts[-1] < n:
        start = cuts[-1]
        end = min(n, start + target)
        # Bytes of inner MAC input of values start..end: their data plus a pad and prefix each.
        size = int(offs[end]) - int(offs[start]) + (end - start) * (64 + prefix_len)
        if size > CHUNK_BYTES:
            per_value = (offs[start + 1:end + 1] - int(offs[start])
                         + np.arange(1, end - start + 1) * (64 + prefix_len))
            end = start + max(1, int(np.searchsorted(per_value, CHUNK_BYTES, side="right")))
        cuts.append(end)
    return [_binary(values.slice(a, b - a)) for a, b in zip(cuts, cuts[1:])]


def native_macs(values: pa.Array, key: bytes, prefix: bytes) -> bytes | None:
    """Concatenated HMAC-SHA256(key, prefix || value) of each value of a string or binary array
    without nulls, in order; None when the native path is unavailable or its answer is not
    trusted (then compute them with hashlib)."""
    n = len(values)
    if n < MIN_VALUES or values.null_count:
        return None
    df_mod = _datafusion()
    if df_mod is None:
        return None
    ipad, opad = hmac_pads(key)
    try:
        from datafusion import col, lit
        from datafusion import functions as f

        parts = _partitions(values, len(prefix))
        batches = [[pa.record_batch([part], names=["v"])] for part in parts]
        inner = f.digest(f.concat(lit(ipad + prefix), col("v")), "sha256")
        # Each input partition maps to one output partition, in order: no round-robin
        # repartitioning (it would interleave batches of different partitions).
        config = df_mod.SessionConfig().set("datafusion.optimizer.enable_round_robin_repartition", "false")
        query = df_mod.SessionContext(config).create_dataframe(batches).select(
            f.digest(f.concat(lit(opad), inner), "sha256").alias("m"))
        result = query.collect_partitioned()
        if len(result) != len(parts):
            raise ValueError("the wrong number of partitions came back")
        out: list[pa.Array] = []
        for part, got in zip(parts, result):
            arrays = [b.column(0) for b in got]
            if sum(len(a) for a in arrays) != len(part):
                raise ValueError("a partition came back with the wrong number of rows")
            out += arrays
        macs = (pa.concat_arrays(out) if len(out) > 1 else out[0]).cast(pa.binary(MAC_BYTES))
        if macs.null_count or len(macs) != n:
            raise ValueError("the MAC array has nulls or the wrong length")
        blob = macs.buffers()[1][macs.offset * MAC_BYTES:(macs.offset + n) * MAC_BYTES].to_pybytes()
        # Spot checks against hashlib: the first value of every result batch and the last value
        # (a batch out of place or a wrong MAC would show), about one check per 8k values.
        picks = sorted({n - 1, *np.cumsum([0] + [len(a) for a in out[:-1]]).tolist()})
    except Exception as exc:  # any failure: the caller computes the MACs with hashlib
        _log.warning("native HMAC computation failed (%s); computing tokens with hashlib", type(exc).__name__)
        return None
    check = HmacSha256(key).with_prefix(prefix)
    expected = check.many(_binary(values).take(pa.array(picks)).to_pylist())
    got = b"".join(blob[i * MAC_BYTES:(i + 1) * MAC_BYTES] for i in picks)
    if got != expected:
        _log.warning("native HMAC results failed the spot check; computing tokens with hashlib")
        return None
    return blob

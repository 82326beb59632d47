"""Hand-over look-up on a large audit log, without and with the partial index, in the same run.

    python benchmarks/audit_handover_lookup.py [--entries 100000] [--repeat 5] [--no-postgres]

Builds a log of ``--entries`` entries with two key hand-overs, then times a cold
``AuditLog.handover_notes()`` (on a freshly opened log object, so the whole log is searched; the
open itself is not timed) with the index dropped (the scan every log did before it existed) and
with it present; prints both and their ratio, the one-time cost of adding the index to the
existing log on open, and batched appends/s with and without the index (its cost on writes). SQLite always; PostgreSQL when reachable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import best_of  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from securetrain.audit.indexes import HANDOVER_INDEX  # noqa: E402
from securetrain.audit.log import AuditLog  # noqa: E402

PG_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
LIBPQ = PG_URL.replace("postgresql+psycopg://", "postgresql://")
DETAILS = {"rows": 1234, "sha256": "ab" * 32, "columns": ["a", "b", "c"]}


def fill(log: AuditLog, n: int, batch: int = 2000) -> None:
    for lo in range(0, n, batch):
        log.append_many([("dataset.read", f"dataset:{i}", "success", DETAILS) for i in range(lo, min(n, lo + batch))])


def build(url: str, n: int, schema: str | None) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    with AuditLog(url, schema=schema, signing_key=key, checkpoint_every=None) as log:
        fill(log, n // 2)
        log.rotate_key(Ed25519PrivateKey.generate())
        fill(log, n - n // 2 - 2)
        log.rotate_key(Ed25519PrivateKey.generate())
        assert log.size() == n
        return log.signing_key  # type: ignore[return-value]


def lookup(url: str, schema: str | None, key: Ed25519PrivateKey) -> tuple[list[str], float]:
    """The hand-over notes and the seconds handover_notes() took on a freshly opened log (a cold search)."""
    with AuditLog(url, schema=schema, signing_key=key, create=False) as log:  # create=False: never adds the index
        log.size()  # connect first: the connection is not what is measured
        t = time.perf_counter()
        notes = log.handover_notes()
        return notes, time.perf_counter() - t


def best_lookup(url: str, schema: str | None, key: Ed25519PrivateKey, repeat: int) -> float:
    return min(lookup(url, schema, key)[1] for _ in range(repeat))


def drop_index(url: str, schema: str | None) -> None:
    if schema is None:
        with sqlite3.connect(url.split(":///", 1)[1]) as conn:
            conn.execute(f"DROP INDEX IF EXISTS {HANDOVER_INDEX}")
    else:
        import psycopg

        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f'DROP INDEX IF EXISTS "{schema}".{HANDOVER_INDEX}')


def appends_per_s(url: str, schema: str | None, n: int, with_index: bool) -> float:
    with AuditLog(url, schema=schema, signing_key=Ed25519PrivateKey.generate(), checkpoint_every=None) as log:
        if not with_index:
            drop_index(url, schema)
        return n / best_of(lambda: fill(log, n, batch=500), 1)


def append_rates(name: str, urls: list[tuple[str, str | None]], n: int, rounds: int) -> None:
    """Best of ``rounds`` alternating runs each (fresh logs), with and without the index."""
    best = {True: 0.0, False: 0.0}
    for i in range(rounds):
        for with_index in (True, False):
            url, schema = urls[2 * i + (0 if with_index else 1)]
            best[with_index] = max(best[with_index], appends_per_s(url, schema, n, with_index))
    print(f"[{name}] batched appends/s (500 per batch, best of {rounds}): with index {best[True]:,.0f}, "
          f"without {best[False]:,.0f} ({best[True] / best[False]:.2f}x)")


def run(name: str, url: str, schema: str | None, n: int, repeat: int) -> None:
    t = time.perf_counter()
    key = build(url, n, schema)
    print(f"[{name}] built {n} entries with 2 hand-overs in {time.perf_counter() - t:.1f} s")
    drop_index(url, schema)
    want = lookup(url, schema, key)[0]
    assert len(want) == 2
    scan = best_lookup(url, schema, key, repeat)
    t = time.perf_counter()
    AuditLog(url, schema=schema, signing_key=key).close()  # an existing log gets the index on open
    add = time.perf_counter() - t
    assert lookup(url, schema, key)[0] == want  # same hand-overs through the index
    indexed = best_lookup(url, schema, key, repeat)
    print(f"[{name}] cold handover_notes() on a {n}-entry log, best of {repeat}: scan {scan * 1e3:.2f} ms, "
          f"index {indexed * 1e3:.2f} ms ({scan / indexed:.1f}x faster)")
    print(f"[{name}] opening the existing log once more with create=True adds the index: {add * 1e3:.0f} ms (once)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--appends", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    logging.getLogger("securetrain.audit").setLevel(logging.ERROR)  # the rotations' warnings
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("SECURETRAIN_DATA_DIR", tmp)
        run("sqlite", f"sqlite:///{tmp}/audit.db", None, args.entries, args.repeat)
        append_rates("sqlite", [(f"sqlite:///{tmp}/a{i}.db", None) for i in range(2 * args.rounds)], args.appends,
                     args.rounds)
    if args.no_postgres:
        return
    try:
        import psycopg

        psycopg.connect(LIBPQ, connect_timeout=3).close()
    except Exception as exc:  # noqa: BLE001 - optional part of the benchmark
        print(f"[postgres] skipped: {type(exc).__name__}")
        return
    schemas = [f"bench_ho_{uuid.uuid4().hex[:8]}" for _ in range(1 + 2 * args.rounds)]
    try:
        run("postgres", PG_URL, schemas[0], args.entries, args.repeat)
        append_rates("postgres", [(PG_URL, s) for s in schemas[1:]], args.appends, args.rounds)
    finally:
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            for s in schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')


if __name__ == "__main__":
    main()

"""Audit-log throughput vs baselines measured in the same run.

    python benchmarks/audit_throughput.py [--quick] [--no-postgres]

Prints appends/s (one transaction per entry, and batched), verify entries/s, next to a raw
SQLAlchemy insert of the same row shape (same transaction pattern) and raw hashlib SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import uuid

from sqlalchemy import BigInteger, Column, MetaData, String, Table, Text, create_engine, insert

PG_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def rate(n: int, fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t0)


def raw_baseline(url: str, n: int, batch: int, schema: str | None) -> tuple[float, float]:
    md = MetaData(schema=schema)
    t = Table(f"bench_raw_{uuid.uuid4().hex[:6]}", md, Column("seq", BigInteger, primary_key=True, autoincrement=False),
              *(Column(c, String(256)) for c in ("ts", "actor", "hostname", "mac", "action", "resource", "outcome")),
              Column("details", Text), Column("prev_hash", String(64)), Column("entry_hash", String(64)))
    engine = create_engine(url)
    md.create_all(engine)
    row = {c: "x" * 16 for c in ("ts", "actor", "hostname", "mac", "action", "resource", "outcome", "details")}
    row |= {"prev_hash": "0" * 64, "entry_hash": "1" * 64}

    def single() -> None:
        for i in range(n):
            with engine.begin() as conn:
                conn.execute(insert(t), [{**row, "seq": i}])

    def batched() -> None:
        for start in range(n, 2 * n, batch):
            with engine.begin() as conn:
                conn.execute(insert(t), [{**row, "seq": i} for i in range(start, start + batch)])

    out = rate(n, single), rate(n, batched)
    t.drop(engine)
    engine.dispose()
    return out


def bench(name: str, url: str, n: int, batch: int, schema: str | None) -> None:
    from securetrain.audit.log import AuditLog

    log = AuditLog(url, schema=schema, checkpoint_every=None)
    details = {"rows": 1000, "sha256": "ab" * 32, "key_id": "kms:key-1"}
    single = rate(n, lambda: [log.record("dataset.read", f"ds:{i}", details=details) for i in range(n)])
    batched = rate(n, lambda: [log.append_many([("dataset.read", f"ds:{i}", "success", details)
                                                for i in range(s, s + batch)]) for s in range(0, n, batch)])
    log.checkpoint()
    total = log.size()
    ver = rate(total, lambda: log.verify().raise_for_failure())
    raw_single, raw_batched = raw_baseline(url, n, batch, schema)
    sample = next(iter(log.entries())).hashed_bytes()
    hashr = rate(20000, lambda: [hashlib.sha256(sample).digest() for _ in range(20000)])
    log.close()
    print(f"{name:10s} append single  {single:9.0f}/s   raw insert {raw_single:9.0f}/s   ratio {single / raw_single:5.2f}")
    print(f"{name:10s} append batch   {batched:9.0f}/s   raw insert {raw_batched:9.0f}/s   ratio {batched / raw_batched:5.2f}")
    print(f"{name:10s} verify         {ver:9.0f}/s   raw sha256 {hashr:9.0f}/s   ratio {ver / hashr:5.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-postgres", action="store_true")
    args = ap.parse_args()
    n, batch = (300, 100) if args.quick else (3000, 500)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("SECURETRAIN_DATA_DIR", tmp)
        bench("sqlite", f"sqlite:///{tmp}/bench.db", n, batch, None)
        if not args.no_postgres:
            schema = f"st_audit_bench_{uuid.uuid4().hex[:8]}"
            try:
                bench("postgres", PG_URL, n, batch, schema)
            except Exception as exc:  # noqa: BLE001 - report and continue
                print(f"postgres   skipped: {type(exc).__name__}: {str(exc)[:120]}")
            finally:
                try:
                    eng = create_engine(PG_URL)
                    with eng.begin() as conn:
                        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                    eng.dispose()
                except Exception:  # noqa: BLE001
                    pass


if __name__ == "__main__":
    main()

"""16 processes appending at once never fork the chain (SQLite and PostgreSQL)."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from pathlib import Path

import pytest

from conftest import POSTGRES_URL
from securetrain.audit.log import AuditLog

PROCS, PER_PROC = 16, 20


def _writer(url: str, schema: str | None, key_path: str, worker: int, barrier) -> None:  # noqa: ANN001
    log = AuditLog(url, schema=schema, actor=f"worker-{worker}", signing_key=key_path, checkpoint_every=40)
    barrier.wait()
    for i in range(PER_PROC):
        if i % 5 == 4:
            log.append_many([("proc.batch", f"w{worker}:{i}:{j}", "success", {"w": worker, "i": i}) for j in range(2)])
        else:
            log.record("proc.write", f"w{worker}:{i}", details={"w": worker, "i": i})
    log.close()


def _hammer(url: str, schema: str | None, key_path: str) -> AuditLog:
    parent = AuditLog(url, schema=schema, signing_key=key_path, checkpoint_every=40)  # creates the schema once
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(PROCS)
    procs = [ctx.Process(target=_writer, args=(url, schema, key_path, w, barrier)) for w in range(PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return parent


def _check(log: AuditLog) -> None:
    entries = list(log.entries())
    per_proc = PER_PROC + PER_PROC // 5  # batched iterations add one extra entry each
    assert len(entries) == PROCS * per_proc
    assert [e.seq for e in entries] == list(range(len(entries)))  # dense
    parents = [e.prev_hash for e in entries]
    assert len(set(parents)) == len(parents)  # no two entries share a parent: no fork
    assert len({e.actor for e in entries}) == PROCS
    report = log.verify()
    assert report.ok, report.error
    sizes = [c.tree_size for c in log.checkpoints()]
    assert sizes == sorted(set(sizes)) and len(sizes) >= 5 and report.checkpoints_verified == len(sizes)


def _keygen(tmp_path: Path) -> str:
    from securetrain.audit.keys import create_signing_key

    create_signing_key(tmp_path / "key.pem")
    return str(tmp_path / "key.pem")


@pytest.mark.slow
def test_sixteen_processes_sqlite(tmp_path: Path) -> None:
    log = _hammer(str(tmp_path / "audit.db"), None, _keygen(tmp_path))
    _check(log)
    log.close()


@pytest.mark.slow
@pytest.mark.postgres
def test_sixteen_processes_postgres(tmp_path: Path) -> None:
    psycopg = pytest.importorskip("psycopg")
    libpq = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    try:
        psycopg.connect(libpq, connect_timeout=3).close()
    except psycopg.OperationalError:
        pytest.skip(f"PostgreSQL not reachable at {libpq}")
    schema = f"st_audit_conc_{uuid.uuid4().hex[:10]}"
    try:
        log = _hammer(POSTGRES_URL, schema, _keygen(tmp_path))
        _check(log)
        log.close()
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

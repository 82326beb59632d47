"""AuditLog used from forked/spawned workers and threads, on SQLite and PostgreSQL; typed DB errors."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import POSTGRES_URL
from securetrain.audit.errors import (
    AuditConnectionError,
    AuditLockTimeoutError,
    AuditPermissionError,
    AuditRefusedError,
)
from securetrain.audit.log import AuditLog

REPO = Path(__file__).resolve().parents[2]
LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


def _pg_reachable() -> bool:
    try:
        import psycopg

        psycopg.connect(LIBPQ, connect_timeout=3).close()
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def audit_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str | None]]:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    if request.param == "sqlite":
        yield str(tmp_path / "audit.db"), None
        return
    if not _pg_reachable():
        pytest.skip("PostgreSQL not reachable")
    import psycopg

    schema = f"st_audit_wk_{uuid.uuid4().hex[:10]}"
    yield POSTGRES_URL, schema
    with psycopg.connect(LIBPQ, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _key(tmp_path: Path) -> str:
    from securetrain.audit.keys import load_or_create_signing_key

    path = tmp_path / "audit-key.pem"
    load_or_create_signing_key(path)
    return str(path)


def _check(log: AuditLog, n: int) -> None:
    entries = list(log.entries())
    assert [e.seq for e in entries] == list(range(n))
    assert len({e.prev_hash for e in entries}) == n
    report = log.verify()
    assert report.ok, report.error


_FORKED: AuditLog | None = None


def _forked_child(worker: int) -> None:
    assert _FORKED is not None
    for i in range(15):
        _FORKED.record("worker.read", f"w{worker}:{i}", details={"i": i})


def test_forked_children_use_their_own_connections(audit_url: tuple[str, str | None], tmp_path: Path) -> None:
    """The parent's pooled connections are in use when it forks; children must not share them,
    and the parent keeps working afterwards (its sessions were not closed by the children)."""
    global _FORKED
    url, schema = audit_url
    log = AuditLog(url, schema=schema, signing_key=_key(tmp_path), checkpoint_every=25)
    for i in range(5):
        log.record("parent.write", f"p:{i}")
    _FORKED = log
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_forked_child, args=(w,)) for w in range(4)]
    for p in procs:
        p.start()
    for i in range(5, 10):  # the parent writes while the children do
        log.record("parent.write", f"p:{i}")
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    for i in range(10, 15):
        log.record("parent.write", f"p:{i}")
    _check(log, 15 + 4 * 15)
    log.close()


def _dicom_loader_run(url: str, schema: str | None, key: str, tmp_path: Path, context: str) -> int:
    from securetrain.masking.dicom.dataset import DicomDataset
    from securetrain.masking.dicom.synthetic import generate_study_set

    src = generate_study_set(tmp_path / "dicom", n_patients=2, studies_per_patient=2, images_per_series=2)
    log = AuditLog(url, schema=schema, signing_key=key, checkpoint_every=10)
    ds = DicomDataset(src, REPO / "policies" / "dicom-basic.yaml", bytes(range(32)), size=8, audit=log)
    loader = ds.dataloader(batch_size=2, num_workers=2, multiprocessing_context=context)
    seen = sum(batch["pixels"].shape[0] for _ in range(2) for batch in loader)  # two epochs
    assert seen == 2 * len(ds)
    reads = sum(1 for e in log.entries() if e.action == "dicom.read")
    assert reads == 2 * len(ds)  # every load of every epoch is recorded, in whichever worker
    n = log.size()
    _check(log, n)
    log.close()
    return n


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dicom_dataloader_workers(audit_url: tuple[str, str | None], tmp_path: Path, context: str) -> None:
    url, schema = audit_url
    _dicom_loader_run(url, schema, _key(tmp_path), tmp_path, context)


def test_threads_are_group_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None, group_commit_window_s=0.002)
    batches: list[int] = []
    original = log._commit_batch

    def counting(batch):  # noqa: ANN001, ANN202
        batches.append(sum(len(r.events) for r in batch))
        return original(batch)

    log._commit_batch = counting  # type: ignore[method-assign]
    barrier = threading.Barrier(8)
    results: list[int] = []

    def work(t: int) -> None:
        barrier.wait()
        for i in range(25):
            entry = log.record("thread.write", f"t{t}:{i}")
            results.append(entry.seq)  # returned only once committed: the seq is final

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(200)) and sum(batches) == 200
    assert len(batches) < 200 and max(batches) > 1  # several calls shared one transaction
    persisted = {e.seq: e.resource for e in log.entries()}
    assert len(persisted) == 200
    _check(log, 200)
    log.close()


# -- typed database errors -------------------------------------------------------------------

def test_sqlite_lock_timeout_is_reported_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    log = AuditLog(tmp_path / "audit.db", busy_timeout_s=0.2)
    log.record("a.b", "r")
    holder = sqlite3.connect(tmp_path / "audit.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(AuditLockTimeoutError) as err:
            log.record("a.b", "r2")
        assert "tamper" not in str(err.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    log.record("a.b", "r3")
    assert log.size() == 2


def test_only_trigger_or_constraint_refusals_mention_tampering() -> None:
    import psycopg
    from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

    from securetrain.audit.dberrors import classify
    from securetrain.audit.errors import AuditDatabaseError

    trig = sqlite3.IntegrityError("audit_entries is append-only: seq must be max+1 and prev_hash must link")
    err = classify(IntegrityError("INSERT", {}, trig), backend="sqlite")
    assert isinstance(err, AuditRefusedError) and "tampered" in str(err)
    pg_trig = psycopg.errors.IntegrityConstraintViolation("audit_entries is append-only: seq must be max+1")
    assert isinstance(classify(IntegrityError("INSERT", {}, pg_trig), backend="postgresql"), AuditRefusedError)
    # the misreport of issue 10: a prepared statement lost with a connection shared across fork
    lost = psycopg.errors.InvalidSqlStatementName('prepared statement "_pg3_0" does not exist')
    err = classify(DBAPIError("INSERT", {}, lost), backend="postgresql")
    assert type(err) is AuditDatabaseError and "tamper" not in str(err)
    gone = psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")
    err = classify(OperationalError("SELECT", {}, gone), backend="postgresql")
    assert isinstance(err, AuditConnectionError) and "tamper" not in str(err)
    ro = sqlite3.OperationalError("attempt to write a readonly database")
    assert isinstance(classify(OperationalError("INSERT", {}, ro), backend="sqlite"), AuditPermissionError)
    for exc in (psycopg.errors.InsufficientPrivilege("permission denied for table audit_entries"),):
        assert isinstance(classify(DBAPIError("INSERT", {}, exc), backend="postgresql"), AuditPermissionError)
    for exc in (psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"),
                psycopg.errors.QueryCanceled("canceling statement due to statement timeout")):
        assert isinstance(classify(DBAPIError("SELECT", {}, exc), backend="postgresql"), AuditLockTimeoutError)


@pytest.mark.postgres
def test_postgres_errors_are_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _pg_reachable():
        pytest.skip("PostgreSQL not reachable")
    import psycopg

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    with pytest.raises(AuditConnectionError, match="failed or was lost"):
        AuditLog("postgresql+psycopg://postgres@127.0.0.1:1/test", schema="st_nowhere")
    schema = f"st_audit_err_{uuid.uuid4().hex[:10]}"
    role = f"st_ro_{uuid.uuid4().hex[:8]}"
    log = AuditLog(POSTGRES_URL, schema=schema)
    try:
        log.record("a.b", "r")
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN")
            conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
            conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
        reader = AuditLog(POSTGRES_URL.replace("postgres@", f"{role}@"), schema=schema, create=False)
        with pytest.raises(AuditPermissionError) as err:
            reader.record("a.b", "r2")
        assert "tamper" not in str(err.value) and "provision_postgres" in str(err.value)
        reader.close()
        # a lock held by a stuck session: lock timeout, not tampering
        with psycopg.connect(LIBPQ) as stuck:
            stuck.execute("SELECT pg_advisory_xact_lock(%s)", (log._lock_key,))
            impatient = AuditLog(POSTGRES_URL + "?options=-c%20lock_timeout%3D200", schema=schema, create=False)
            with pytest.raises(AuditLockTimeoutError):
                impatient.record("a.b", "r3")
            impatient.close()
            stuck.rollback()
    finally:
        log.close()
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.execute(f"DROP ROLE IF EXISTS {role}")


def _child_records(log: AuditLog, worker: int) -> None:
    for i in range(10):
        log.record("child.write", f"c{worker}:{i}")


def test_fork_while_a_parent_thread_is_appending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite keeps lock state in process memory: forking mid-transaction must not hand the child a
    'lock held' it can never release (it would time out on every append)."""
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    # A stale inherited lock would make every child append time out; 10 s keeps that failure quick
    # while a loaded machine (the parent thread competes for the same write lock) still passes.
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None, busy_timeout_s=10.0)
    stop = threading.Event()

    def busy() -> None:
        i = 0
        while not stop.is_set():
            log.record("parent.write", f"p:{i}")
            i += 1
            time.sleep(0.0005)  # still appending nearly all the time, without starving the children

    writer = threading.Thread(target=busy)
    writer.start()
    try:
        ctx = mp.get_context("fork")
        for round_ in range(4):
            procs = [ctx.Process(target=_child_records, args=(log, 10 * round_ + w)) for w in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(60)
            assert [p.exitcode for p in procs] == [0, 0]
    finally:
        stop.set()
        writer.join()
    assert sum(1 for e in log.entries() if e.action == "child.write") == 80
    assert log.verify().ok
    log.close()


# --- warm_up: a new worker opens its PostgreSQL connection while it reads, not after -------------

def _warm_child(log: AuditLog, out) -> None:  # noqa: ANN001
    started = log.warm_up()
    again = log.warm_up()  # already opening: no second thread, no second connection
    deadline = time.monotonic() + 30
    while log._pg_conn is None and time.monotonic() < deadline:
        time.sleep(0.005)
    opened = log._pg_conn is not None
    pid = None if not opened else log._pg_conn.info.backend_pid
    log.record("worker.read", "after-warm-up")
    out.put((started, again, opened, pid, log._pg_conn.info.backend_pid, log.warm_up()))


@pytest.mark.postgres
def test_warm_up_opens_a_forked_workers_connection_in_the_background(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if not _pg_reachable():
        pytest.skip("PostgreSQL not reachable")
    import psycopg

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    schema = f"st_audit_warm_{uuid.uuid4().hex[:10]}"
    log = AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=None)
    try:
        log.record("parent.write", "p0")
        assert log.warm_up() is False  # the parent's connection is open (or it uses a committer)
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_warm_child, args=(log, out))
        child.start()
        started, again, opened, warm_pid, used_pid, after = out.get(timeout=60)
        child.join(30)
        assert child.exitcode == 0
        assert (started, again, opened, after) == (True, False, True, False)
        assert warm_pid == used_pid  # the append used the connection the warm-up opened
        log.record("parent.write", "p1")  # the parent's own session is untouched
        _check(log, 3)
    finally:
        log.close()
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_warm_up_is_a_no_op_on_sqlite_and_leaves_errors_to_the_first_append(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=None)
    assert log.warm_up() is False
    log.record("a.b", "r")
    log.close()
    if not _pg_reachable():
        return
    import psycopg

    schema = f"st_audit_warm_{uuid.uuid4().hex[:10]}"
    pg = AuditLog(POSTGRES_URL, schema=schema, checkpoint_every=None, shared_commit=False)
    try:
        # The server goes away before the warm-up connects: nothing is raised in the thread, and the
        # first append reports the lost connection as it would have without a warm-up.
        pg._pg_conn = None
        pg._pg_sql_cache = None
        engine_url = pg._current_engines()[2].url
        pg._current_engines()[2].url = engine_url.set(port=1)  # unreachable
        assert pg.warm_up() is True
        deadline = time.monotonic() + 30
        while pg._warming and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pg._pg_conn is None and not pg._warming
        with pytest.raises(AuditConnectionError):
            pg.record("a.b", "r")
        pg._current_engines()[2].url = engine_url
        pg.record("a.b", "r2")  # reconnects on the next append
        assert [e.resource for e in pg.entries()] == ["r2"]
    finally:
        pg.close()
        with psycopg.connect(LIBPQ, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class _WarmUpCounter:
    """An audit recorder that only counts warm_up() calls per process (in a shared file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass

    def warm_up(self) -> bool:
        import os

        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return True


@pytest.mark.parametrize("workers", [0, 2])
def test_dicom_dataset_warms_the_audit_log_once_per_worker(tmp_path: Path, workers: int) -> None:
    import os

    from securetrain.masking.dicom.dataset import DicomDataset
    from securetrain.masking.dicom.synthetic import generate_study_set

    src = generate_study_set(tmp_path / "dicom", n_patients=2, studies_per_patient=1, images_per_series=4)
    calls = tmp_path / "warm-ups.txt"
    ds = DicomDataset(src, REPO / "policies" / "dicom-basic.yaml", bytes(range(32)), size=8,
                      audit=_WarmUpCounter(calls))  # type: ignore[arg-type]
    loader = ds.dataloader(batch_size=2, num_workers=workers, multiprocessing_context="fork" if workers else None)
    assert sum(batch["pixels"].shape[0] for batch in loader) == len(ds)
    pids = calls.read_text().split() if calls.exists() else []
    if workers == 0:
        assert pids == []  # the constructing process appended already: nothing to warm
    else:
        assert len(pids) == len(set(pids)) == workers  # once in each worker, never in the parent
        assert str(os.getpid()) not in pids

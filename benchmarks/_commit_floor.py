"""The floor for durable appends from 8 processes: a bare shared committer, nothing else.

8 client processes each send one small frame over a Unix socket and wait for the answer; one server
thread selects, reads what has arrived, and commits it in one transaction (SQLite: WAL,
``synchronous=FULL``; PostgreSQL: ``synchronous_commit=on``, BEGIN + INSERT + COMMIT in one
pipelined round trip), then answers each client. No hashing, no validation, no chain, no framing:
what any Python design of the shared commit costs at least on the machine it runs on, so
``benchmarks/audit_throughput.py`` can print the audit log's durable rate as a ratio to it.

``chain=True`` adds the database work every design of the audit log must do, and nothing else: the
log's own table with its insert guard (trigger), the head read under the log's lock, and the
SHA-256 chain over the canonical entry bytes (PostgreSQL: the advisory lock and the server's view
in a first round trip, as the log needs the view's time before it can hash). Still no validation,
no framing, no client-side re-hash.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import time
import uuid

_DETAILS = '{"rows":1000,"sha256":"' + "ab" * 32 + '"}'
_MESSAGE = b'{"action":"dataset.read","resource":"ds:1:1","details":{"rows":1000,"sha256":"' + b"ab" * 32 + b'"}}'


def _open_sqlite(path: str):  # noqa: ANN202
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE floor_e (seq INTEGER PRIMARY KEY, body TEXT)")

    def commit(rows: list[tuple[int, str]]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO floor_e VALUES (?, ?)", rows)
        conn.execute("COMMIT")

    return commit, conn.close


def _chained(prev: str, rows: list[tuple[int, str]], view_json: str | None) -> list[tuple[str, ...]]:
    """The log's stored columns for ``rows`` chained onto ``prev`` (seq, ts, actor, hostname, mac,
    action, resource, outcome, details, prev_hash, entry_hash)."""
    import hashlib

    from securetrain.audit.canonical import entry_bytes, utc_timestamp

    out = []
    for seq, _body in rows:
        ts = utc_timestamp()
        digest = hashlib.sha256(entry_bytes(
            seq=seq, ts=ts, actor="bench", hostname="host", mac="00:00:00:00:00:00", action="dataset.read",
            resource=f"ds:{seq}", outcome="success", details_json=_DETAILS, prev_hash=prev,
            server_view_json=view_json)).hexdigest()
        out.append((seq, ts, "bench", "host", "00:00:00:00:00:00", "dataset.read", f"ds:{seq}", "success", _DETAILS,
                    prev, digest))
        prev = digest
    return out


def _open_sqlite_chain(path: str):  # noqa: ANN202
    import sqlite3

    from sqlalchemy import create_engine

    from securetrain.audit.models import sqlite_tables
    from securetrain.audit.triggers import sqlite_ddl

    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as c:
        for table in sqlite_tables():
            table.create(c)
        for stmt in sqlite_ddl():
            c.exec_driver_sql(stmt)
    engine.dispose()
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL", "PRAGMA recursive_triggers=ON"):
        conn.execute(pragma)
    insert = f"INSERT INTO audit_entries VALUES ({', '.join('?' * 11)})"

    def commit(rows: list[tuple[int, str]]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        head = conn.execute("SELECT entry_hash FROM audit_entries ORDER BY seq DESC LIMIT 1").fetchone()
        conn.executemany(insert, _chained(head[0] if head else "0" * 64, rows, None))
        conn.execute("COMMIT")

    return commit, conn.close


def _open_postgres_chain(url: str, schema: str):  # noqa: ANN202
    import json

    import psycopg
    from sqlalchemy import MetaData
    from sqlalchemy.engine import make_url

    from securetrain.audit.canonical import canonical_bytes_validated
    from securetrain.audit.models import TABLES
    from securetrain.audit.triggers import SERVER_VIEW_SQL, postgres_ddl

    u = make_url(url)
    conn = psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password, dbname=u.database,
                           autocommit=True)
    conn.execute(f'CREATE SCHEMA "{schema}"')
    md = MetaData(schema=schema)
    for table in TABLES:
        table.to_metadata(md)
    from sqlalchemy import create_engine

    engine = create_engine(url)
    with engine.begin() as c:
        md.create_all(c)
        for stmt in postgres_ddl(schema):
            c.exec_driver_sql(stmt.replace("%", "%%"))
    engine.dispose()
    table = f'"{schema}".audit_entries'
    keys = ("seq", "ts", "actor", "hostname", "mac", "action", "resource", "outcome", "details", "prev_hash",
            "entry_hash")
    begin = (f"BEGIN; SELECT pg_advisory_xact_lock(42); SELECT {SERVER_VIEW_SQL}, h.entry_hash FROM (SELECT 1) AS one "
             f"LEFT JOIN (SELECT entry_hash FROM {table} ORDER BY seq DESC LIMIT 1) AS h ON true")
    record = ", ".join(f"{k} {'bigint' if k == 'seq' else 'text'}" for k in keys)
    insert = (f"INSERT INTO {table} ({', '.join(keys)}, server_view) SELECT {', '.join('u.' + k for k in keys)}, %s "
              f"FROM json_to_recordset(%s::json) AS u({record})")  # nosec B608 - generated names
    cur = conn.cursor()

    def commit(rows: list[tuple[int, str]]) -> None:
        cur.execute(begin)
        cur.nextset()
        cur.nextset()
        role, addr, time_, head = cur.fetchone()
        view_json = canonical_bytes_validated({"addr": addr, "role": role, "time": time_}).decode()
        chained = _chained(head or "0" * 64, rows, view_json)
        with conn.pipeline():
            cur.execute(insert, (view_json, json.dumps([dict(zip(keys, r, strict=True)) for r in chained])))
            cur.execute("COMMIT")

    def close() -> None:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        conn.close()

    return commit, close


def _open_postgres(url: str, table: str):  # noqa: ANN202
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    conn = psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password, dbname=u.database,
                           autocommit=True)
    conn.execute(f"CREATE TABLE {table} (seq bigint PRIMARY KEY, body text)")
    cur = conn.cursor()

    def commit(rows: list[tuple[int, str]]) -> None:
        with conn.pipeline():
            cur.execute("BEGIN")
            cur.executemany(f"INSERT INTO {table} VALUES (%s, %s)", rows)  # nosec B608 - generated name
            cur.execute("COMMIT")

    def close() -> None:
        conn.execute(f"DROP TABLE {table}")
        conn.close()

    return commit, close


def _serve(target: str, address: str, total: int, ready, chain: bool) -> None:  # noqa: ANN001
    name = f"floor_{uuid.uuid4().hex[:8]}"
    if target.startswith("postgresql"):
        commit, close = _open_postgres_chain(target, name) if chain else _open_postgres(target, name)
    else:
        commit, close = _open_sqlite_chain(target) if chain else _open_sqlite(target)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    ready.set()
    seq = 0
    while seq < total:
        batch = []
        for key, _ in selector.select():
            sock = key.fileobj
            if sock is listener:
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ)
                continue
            data = sock.recv(4096)
            if data:
                batch.append((sock, data))
            else:
                selector.unregister(sock)
        if batch:
            commit([(seq + i, data.decode()) for i, (_, data) in enumerate(batch)])
            seq += len(batch)
            for sock, _ in batch:
                sock.sendall(b"%d" % seq)
    close()


def _client(address: str, n: int, ready, barrier) -> None:  # noqa: ANN001
    ready.wait()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    barrier.wait()
    for _ in range(n):
        sock.sendall(_MESSAGE)
        sock.recv(64)


def floor_rate(target: str, n: int, procs: int = 8, chain: bool = False) -> float:
    """Durable appends/s of the bare committer: ``target`` is a SQLite file path or a PostgreSQL URL;
    ``chain``: with the log's own database work (see the module's docstring)."""
    ctx = mp.get_context("fork")
    address = f"\0securetrain-bench-floor-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ready, barrier = ctx.Event(), ctx.Barrier(procs + 1)
    server = ctx.Process(target=_serve, args=(target, address, procs * n, ready, chain))
    server.start()
    clients = [ctx.Process(target=_client, args=(address, n, ready, barrier)) for _ in range(procs)]
    for c in clients:
        c.start()
    barrier.wait()
    t0 = time.perf_counter()
    for c in clients:
        c.join()
    wall = time.perf_counter() - t0
    server.join(30)
    return procs * n / wall

"""The floor for durable appends from 8 processes: a bare shared committer, nothing else.

8 client processes each send one small frame over a Unix socket and wait for the answer; one server
thread selects, reads what has arrived, and commits it in one transaction (SQLite: WAL,
``synchronous=FULL``; PostgreSQL: ``synchronous_commit=on``, BEGIN + INSERT + COMMIT in one
pipelined round trip), then answers each client. No hashing, no validation, no chain, no framing:
what any Python design of the shared commit costs at least on the machine it runs on, so
``benchmarks/audit_throughput.py`` can print the audit log's durable rate as a ratio to it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import time
import uuid

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


def _serve(target: str, address: str, total: int, ready) -> None:  # noqa: ANN001
    if target.startswith("postgresql"):
        commit, close = _open_postgres(target, f"floor_{uuid.uuid4().hex[:8]}")
    else:
        commit, close = _open_sqlite(target)
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


def floor_rate(target: str, n: int, procs: int = 8) -> float:
    """Durable appends/s of the bare committer: ``target`` is a SQLite file path or a PostgreSQL URL."""
    ctx = mp.get_context("fork")
    address = f"\0securetrain-bench-floor-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ready, barrier = ctx.Event(), ctx.Barrier(procs + 1)
    server = ctx.Process(target=_serve, args=(target, address, procs * n, ready))
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

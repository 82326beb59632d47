"""The database-backed, hash-chained, append-only audit log.

``AuditLog`` implements :class:`~securetrain.audit.recorder.AuditRecorder`. Each append runs in one
transaction that first takes the log's write lock — SQLite ``BEGIN IMMEDIATE``, PostgreSQL
``pg_advisory_xact_lock`` — then reads the head and assigns ``seq``/``prev_hash`` under the lock, so
concurrent writers (threads or processes) can never fork the chain. Signed checkpoints are written
every ``checkpoint_every`` entries and on demand, and are published to the configured anchors.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import getpass
import hashlib
import json
import logging
import operator
import os
import signal
import socket
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows: SQLite's own lock wait only
    _fcntl = None  # type: ignore[assignment]

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import Connection, Engine, create_engine, event, func, inspect, insert, literal_column, make_url, select, text
from sqlalchemy.exc import DBAPIError

from securetrain.audit import canonical as canon
from securetrain.audit import committer
from securetrain.audit.committer import CommitClient, CommitServer, Unprocessed
from securetrain.audit.anchors import Anchor
from securetrain.audit.dberrors import classify
from securetrain.audit.errors import (
    AuditCheckpointError,
    AuditConfigError,
    AuditError,
    AuditEventError,
    AuditIntegrityError,
    AuditPermissionError,
)
from securetrain.audit.handover import (
    ROTATION_ACTION,
    Handover,
    KeyChain,
    handover_note_of,
    open_handover,
    open_with_chain,
    root_key,
    sign_handover,
    writer_chain,
)
from securetrain.audit.keys import default_origin, load_signing_key, public_key_pem
from securetrain.audit.signers import CheckpointSigner, VaultTransitSigner
from securetrain.audit.indexes import HANDOVER_ACTION_SQL, ensure_handover_index
from securetrain.audit.merkle import (
    NO_PROOF_FROM_EMPTY_TREE,
    CompactRange,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_hash,
)
from securetrain.audit.models import TABLES, AuditCheckpointRow, AuditEntryRow, sqlite_tables
from securetrain.audit.note import (
    Checkpoint,
    parse_checkpoint_text,
    parse_note,
    raw_public_key,
    sign_checkpoint,
    verifier_key,
)
from securetrain.audit.triggers import SERVER_VIEW_SQL, postgres_ddl, postgres_upgrade_ddl, sqlite_ddl
from securetrain.audit.verify import Record, VerifyReport, verify_rows

log = logging.getLogger(__name__)

E = AuditEntryRow.__table__  # type: ignore[attr-defined]
C = AuditCheckpointRow.__table__  # type: ignore[attr-defined]

DEFAULT_PG_SCHEMA = "securetrain_audit"
_BATCH = 2000
#: Most entries in one transaction of an asynchronous log (see AuditLog._take_queued): what another
#: writer of the database waits for at most (measured 10-90 ms with a thread spinning on record()).
_ASYNC_BATCH = 500


def data_dir() -> Path:
    """``$SECURETRAIN_DATA_DIR`` or ``./.securetrain``."""
    return Path(os.environ.get("SECURETRAIN_DATA_DIR", ".securetrain"))


def default_url() -> str:
    return os.environ.get("SECURETRAIN_AUDIT_URL") or str(data_dir() / "audit.db")


def _normalise_url(url_or_path: str | os.PathLike[str] | None) -> str:
    raw = str(url_or_path) if url_or_path is not None else default_url()
    if "://" in raw:
        return raw
    return f"sqlite:///{Path(raw).expanduser().resolve()}"


@dataclass(frozen=True)
class AuditEntry:
    """One entry as stored; ``hashed_bytes()`` are exactly the bytes that were hashed."""

    seq: int
    ts: str
    actor: str
    hostname: str
    mac: str
    action: str
    resource: str
    outcome: str
    details: dict[str, Any]
    prev_hash: str
    entry_hash: str
    #: PostgreSQL: the server's view of the writer (``role``, ``addr``, ``time``), hashed with the
    #: entry; None on SQLite and for entries written before it existed.
    server_view: dict[str, Any] | None = None

    def hashed_object(self) -> dict[str, Any]:
        return canon.entry_object(
            seq=self.seq, ts=self.ts, actor=self.actor, hostname=self.hostname, mac=self.mac, action=self.action,
            resource=self.resource, outcome=self.outcome, details=self.details, prev_hash=self.prev_hash,
            server_view=self.server_view,
        )

    def hashed_bytes(self) -> bytes:
        return canon.canonical_bytes(self.hashed_object())


def _json_object(stored: Any) -> dict[str, Any]:
    """A stored JSON-object column, parsed; damage becomes a marker the verifier rejects."""
    try:
        value = json.loads(stored)
    except (TypeError, json.JSONDecodeError):
        return {"__unparseable__": str(stored)[:64]}
    return value if isinstance(value, dict) else {"__not_an_object__": True}


#: The columns the writer's entry template takes, then the stored hash (see ``_row_batches``).
_TEMPLATE_COLUMNS = ("seq", "ts", "actor", "hostname", "mac", "action", "resource", "outcome", "details", "prev_hash",
                     "entry_hash")


def _plain_fields(obj: dict[str, Any]) -> bool:
    """The top-level fields have the types the format requires (so the C encoder's bytes are JCS)."""
    return type(obj["seq"]) is int and 0 <= obj["seq"] <= canon.MAX_SAFE_INT and all(
        type(obj[name]) is str for name in ("ts", "actor", "hostname", "mac", "action", "resource", "outcome",
                                            "prev_hash"))


def _entry_from_row(row: Any) -> tuple[AuditEntry, str]:
    """Entry plus the raw stored details text (verification checks it is canonical).

    ``server_view`` is read when the table has that column (SQLite tables and PostgreSQL tables not
    yet upgraded do not) and is None when it is NULL (entries written before it existed).
    """
    view_text = getattr(row, "server_view", None)
    return (
        AuditEntry(row.seq, row.ts, row.actor, row.hostname, row.mac, row.action, row.resource, row.outcome,
                   _json_object(row.details), row.prev_hash, row.entry_hash,
                   None if view_text is None else _json_object(view_text)),
        row.details,
    )


class AuditLog:
    """Append-only audit log on SQLite (default) or PostgreSQL. Safe to share across threads."""

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        actor: str | None = None,
        signing_key: Ed25519PrivateKey | CheckpointSigner | str | os.PathLike[str] | None = None,
        origin: str | None = None,
        checkpoint_every: int | None = 1000,
        anchors: Sequence[Anchor] = (),
        schema: str | None = None,
        create: bool = True,
        busy_timeout_s: float = 30.0,
        group_commit_window_s: float = 0.0,
        durable: bool = True,
        shared_commit: bool | None = None,
        max_queued: int = 100_000,
    ) -> None:
        self.url = _normalise_url(url)
        # Kept so a worker process can reopen the same log (see __getstate__).
        self._reopen_args = {"actor": actor, "signing_key": signing_key, "origin": origin,
                             "checkpoint_every": checkpoint_every, "anchors": tuple(anchors), "schema": schema,
                             "busy_timeout_s": busy_timeout_s, "group_commit_window_s": group_commit_window_s,
                             "durable": durable, "shared_commit": shared_commit, "max_queued": max_queued}
        if not 0.0 <= group_commit_window_s <= 1.0:
            raise AuditConfigError("group_commit_window_s must be between 0 and 1 second")
        self.group_commit_window_s = float(group_commit_window_s)
        self.durable = bool(durable)
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise AuditConfigError("max_queued must be a positive number of events")
        # Asynchronous mode: events queued for the background commit at most; record() waits
        # while the queue is full, so a writer faster than the database cannot grow it without bound.
        self.max_queued = max_queued
        if not self.durable:
            _install_exit_flush()
        self.actor = canon._check_text("actor", actor or os.environ.get("SECURETRAIN_ACTOR") or getpass.getuser(), limit=256)
        self.hostname = socket.gethostname() or "unknown"
        self.mac = canon.mac_address()
        self.checkpoint_every = checkpoint_every
        self.anchors = list(anchors)
        self._signing_key_src = signing_key
        self._signing_key: Ed25519PrivateKey | CheckpointSigner | None = (
            signing_key if isinstance(signing_key, (Ed25519PrivateKey, CheckpointSigner)) else None)
        self._origin = origin
        self._lock = threading.RLock()
        self._engine_lock = threading.Lock()
        self._cache = CompactRange()
        self._cache_head = canon.GENESIS_HASH  # entry_hash of the last leaf in _cache
        self._cache_checked: set[tuple[int, bytes]] = set()  # reference checkpoints the cache reproduced
        self._ho_notes: list[tuple[int, str]] = []  # (seq, note) of hand-overs found in the entries so far
        self._ho_scanned = 0  # entries below this seq were searched for hand-overs
        self._chain: KeyChain | None = None  # keys whose checkpoints the writer accepts as references
        self.backend = self.url.split(":", 1)[0].split("+", 1)[0]
        self._busy_timeout_s = busy_timeout_s
        self._engines: tuple[Engine, Engine, Engine | None] | None = None
        # PostgreSQL: this process's dedicated append connection (see _pg_commit_rows).
        self._pg_conn: Any = None
        self._warming = False  # a warm_up() thread is opening _pg_conn
        # SQLite: this process's dedicated append connection (see _sqlite_commit_batch).
        self._sq_conn: sqlite3.Connection | None = None
        self._pg_sql_cache: tuple[str, str, str] | None = None
        # SQLite: this process's descriptor of the writers' turn file (see _writer_turn) and how
        # deeply the turn is held (only touched under self._lock).
        self._turn_fd: int | None = None
        self._wait_fd: int | None = None  # <db>.lock-wait (see _take_turn_lock); -1: could not be opened
        self._turn_depth = 0
        self._turn_path: Path | None = None
        self._turn_queue: _TurnQueue | None = None  # this process's FIFO in front of the flock
        # Whether audit_entries has the server_view column (set when the schema is checked), and
        # whether appends record the server's view in it (PostgreSQL only).
        self._view_column = False
        self._write_view = False
        self._closed = False
        self._pid = os.getpid()
        self._init_group_commit()
        # Cross-process group commit (see securetrain.audit.committer): the address this log's
        # committer serves on (None: every process commits itself), whether this process may serve
        # (it opened the log: not a forked or unpickled copy), and its server or client.
        if shared_commit is None:
            shared_commit = os.environ.get("SECURETRAIN_AUDIT_SHARED_COMMIT", "1").strip().lower() not in (
                "0", "false", "no", "off")
        self._commit_address: str | None = None
        self._owner = True
        self._server: CommitServer | None = None
        self._client: CommitClient | None = None
        self._client_retry_at = 0.0
        share_file: Path | None = None
        if self.backend == "sqlite":
            self.schema = None
            db_file = Path(self.url.split(":///", 1)[1]) if ":///" in self.url else None
            if db_file is not None and str(db_file) != ":memory:":
                self._turn_path = db_file.with_name(db_file.name + ".lock")
                share_file = db_file if shared_commit and committer.supported() else None
                if create:
                    db_file.parent.mkdir(parents=True, exist_ok=True)
                elif not db_file.is_file():
                    # Opening would silently create an empty log that then "verifies": fail closed.
                    raise AuditConfigError(f"no audit database at {db_file}", hint="check --db / SECURETRAIN_AUDIT_URL")
        elif self.backend in ("postgresql", "postgres"):
            self.schema = schema or DEFAULT_PG_SCHEMA
            if not self.schema.replace("_", "").isalnum():
                raise AuditConfigError(f"PostgreSQL schema name {self.schema!r} must be alphanumeric/underscore")
            digest = hashlib.sha256(f"securetrain.audit:{self.schema}".encode()).digest()
            self._lock_key = int.from_bytes(digest[:8], "big", signed=True)
            if shared_commit and committer.supported():
                where = make_url(self.url).render_as_string(hide_password=True)
                self._commit_address = committer.address_for(f"{where}#{self.schema}")
        else:
            raise AuditConfigError(f"unsupported audit database URL scheme {self.backend!r}", hint="use a path, sqlite:/// or postgresql+psycopg://")
        _LIVE_LOGS.add(self)
        if create and checkpoint_every is not None:
            # A writer that will sign checkpoints finds out now, before committing any entry,
            # that it has no key (not after, at the first checkpoint).
            _ = self.signing_key
        if create:
            self._ensure_schema()
        else:
            self._require_schema()
        if share_file is not None:
            # The file as it is now (device and inode): a log replaced under the same name (restored,
            # rebuilt) is another log, never served by a process still holding the old file.
            st = share_file.stat()
            self._commit_address = committer.address_for(f"sqlite:{share_file.resolve()}:{st.st_dev}:{st.st_ino}")

    # -- engines (one set per process) and schema ----------------------------------------
    def _build_engines(self) -> tuple[Engine, Engine, Engine | None]:
        if self.backend == "sqlite":
            return (self._sqlite_engine(immediate=True, timeout=self._busy_timeout_s),
                    self._sqlite_engine(immediate=False, timeout=self._busy_timeout_s), None)
        base = create_engine(self.url, pool_pre_ping=True, pool_size=3, max_overflow=2)
        opts = base.execution_options(schema_translate_map={None: self.schema})
        return opts, opts, base

    def _current_engines(self) -> tuple[Engine, Engine, Engine | None]:
        """This process's engines, created on first use. A forked child never uses its parent's."""
        if self._pid != os.getpid():  # forked without the at-fork hook having run (defensive)
            self._forget_inherited_state()
        engines = self._engines
        if engines is None:
            with self._engine_lock:
                engines = self._engines
                if engines is None:
                    engines = self._engines = self._build_engines()
                    self._closed = False  # used again after close(): flushed at exit again
        return engines

    @property
    def _write_engine(self) -> Engine:
        return self._current_engines()[0]

    @property
    def _read_engine(self) -> Engine:
        return self._current_engines()[1]

    def _forget_inherited_state(self) -> None:
        """In a forked child: drop the parent's pooled connections without closing them.

        Closing them would end the parent's sessions (PostgreSQL) or disturb its locks (SQLite);
        ``dispose(close=False)`` detaches the pool, and the old pools are kept referenced so the
        connections are never even garbage-collected here. Locks and group-commit state held by
        the parent's threads are replaced too.
        """
        engines, self._engines = self._engines, None
        if engines is not None:
            for engine in {id(e): e for e in engines if e is not None}.values():
                _INHERITED.append(engine.pool)
                engine.dispose(close=False)
        if self._pg_conn is not None:  # the parent's session: never used or closed here
            _INHERITED.append(self._pg_conn)
            self._pg_conn = None
        self._warming = False  # a parent's warm-up thread does not exist here
        if self._sq_conn is not None:  # likewise the parent's SQLite handle
            _INHERITED.append(self._sq_conn)
            self._sq_conn = None
        if self._turn_fd is not None:
            # Never held at fork (it is taken under self._lock, which the at-fork hook holds), so
            # closing our copy releases nothing the parent holds; the child opens its own.
            with contextlib.suppress(OSError):
                os.close(self._turn_fd)
            self._turn_fd, self._turn_depth = None, 0
        if self._wait_fd is not None:  # likewise never held at fork
            with contextlib.suppress(OSError):  # (-1: not opened; close fails harmlessly)
                os.close(self._wait_fd)
            self._wait_fd = None
        self._turn_queue = None  # the parent's queue: the child looks up its own (see _turn_queue_for)
        # The parent's committer server or connection: never used here (the child's copies of the
        # sockets close with these objects, which leaves the parent's open). A forked copy commits
        # its own appends (see _committer_client).
        server, client = self._server, self._client
        if server is not None:
            server.forget_in_child()
        if client is not None:
            client.close()
        self._server, self._client, self._owner, self._commit_address = None, None, False, None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._init_group_commit()

    def _sqlite_engine(self, *, immediate: bool, timeout: float) -> Engine:
        engine = create_engine(self.url, connect_args={"timeout": timeout, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            for pragma in _sqlite_pragmas(timeout):
                cur.execute(pragma)
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    @contextlib.contextmanager
    def _writer_turn(self) -> Iterator[None]:
        """SQLite: take the writers' turn around a write transaction: this process's FIFO queue for
        the database, then an exclusive ``flock`` on ``<db>.lock``.

        Only a scheduler in front of ``BEGIN IMMEDIATE``, which stays the lock that keeps the chain
        linear: SQLite's busy handler polls the database lock with sleeps growing to 100 ms, so
        processes contending for it mostly sleep while it is free. Waiting here (polling every
        0.05-2 ms; shorter polls take CPU from the lock holder on small machines) hands the database
        on within a millisecond or two.

        Fairness (issue 10): the log objects (and threads) of one process on one database first
        queue in arrival order (``_TurnQueue``, one per turn file, new in a forked child), and a
        writer ending its transaction hands the turn straight to the oldest waiter. A writer that
        wants the turn again at once (an asynchronous log's flusher whose queue never empties) thus
        queues behind those already waiting: no writer of the process waits for more than one
        transaction of each writer queued ahead of it, and an asynchronous transaction holds at
        most ``_ASYNC_BATCH`` entries (see ``_take_queued``). Before, the flusher took everything
        queued in one transaction and the flock again right after it, so a second log object on
        the same database (a durable one, which does not use this process's committer: see
        ``_SERVING_HERE``) waited seconds or failed with ``AuditLockTimeoutError``. Between
        processes, writers already waiting for the flock go before one that arrives (see
        ``_take_turn_lock``); processes that opened the log themselves normally append through
        the shared committer instead.

        After ``busy_timeout_s`` in all (or when the file cannot be opened or locked) it falls back
        to SQLite's own wait. Re-entrant; call under ``self._lock``.
        """
        fcntl = _fcntl
        if self._turn_path is None or self._turn_depth:
            self._turn_depth += 1
            try:
                yield
            finally:
                self._turn_depth -= 1
            return
        deadline = time.monotonic() + self._busy_timeout_s
        queue = self._turn_queue
        if queue is None:
            queue = self._turn_queue = _turn_queue_for(str(self._turn_path))
        queued = queue.acquire(deadline)
        held = False
        try:
            try:
                if fcntl is not None:
                    if self._turn_fd is None:
                        self._turn_fd = os.open(self._turn_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    if self._wait_fd is None:
                        try:
                            self._wait_fd = os.open(self._turn_path.with_name(self._turn_path.name + "-wait"),
                                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                        except OSError:  # the turn file alone still orders writers, only not fairly
                            self._wait_fd = -1
                    held = self._take_turn_lock(fcntl, self._turn_fd, self._wait_fd, deadline)
            except OSError as exc:  # unwritable directory, no flock: SQLite's lock alone still applies
                log.debug("audit writer turn file unavailable (%s); using SQLite's lock wait", type(exc).__name__)
            self._turn_depth += 1
            try:
                yield
            finally:
                self._turn_depth -= 1
                if held and self._turn_fd is not None:
                    with contextlib.suppress(OSError):
                        fcntl.flock(self._turn_fd, fcntl.LOCK_UN)
        finally:
            if queued:
                queue.release()

    @staticmethod
    def _take_turn_lock(fcntl: Any, turn_fd: int, wait_fd: int, deadline: float) -> bool:
        """The exclusive ``flock`` on the turn file, other processes' writers already waiting first.

        A bare flock polled with sleeps is not first-come: a process that releases it and wants it
        again at once (an asynchronous log whose flusher never runs out of work) takes it back
        before a waiter's next poll, so a waiter in another process (a forked DataLoader worker
        committing its own appends) waited up to 20 of its transactions. A writer that has polled
        for ``_TURN_ESCALATE_S`` holds a shared lock on ``<db>.lock-wait`` until it has the turn; a
        writer that finds the turn free while any is held leaves it to them until one of them has
        taken it (they poll at least every 2 ms; at most ``_TURN_COURTESY_S``), then waits too. A
        writer ending its transaction thus never takes the turn back ahead of a writer that has
        been waiting that long. Locks of a killed process are released by the kernel; a stopped
        waiter delays others by the courtesy bound at most.
        """
        delay = 0.00005
        courtesy_end = min(deadline, time.monotonic() + _TURN_COURTESY_S)
        while wait_fd >= 0:
            try:
                fcntl.flock(wait_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody waiting
                fcntl.flock(wait_fd, fcntl.LOCK_UN)
                break
            except BlockingIOError:
                pass
            try:  # someone waits: while the turn is held, wait as one of them
                fcntl.flock(turn_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                break
            fcntl.flock(turn_fd, fcntl.LOCK_UN)  # free: leave it to them until one of them polls
            if time.monotonic() >= courtesy_end:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.0005)
        waiting = False
        escalate_at = time.monotonic() + _TURN_ESCALATE_S
        try:
            delay = 0.00005
            while True:
                try:
                    fcntl.flock(turn_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    now = time.monotonic()
                    if now >= deadline:
                        return False
                    if not waiting and wait_fd >= 0 and now >= escalate_at:
                        # Waited long enough to ask others to let us in (an exclusive holder of
                        # the wait file only checks, then lets go, so this does not block).
                        fcntl.flock(wait_fd, fcntl.LOCK_SH)
                        waiting = True
                    time.sleep(delay)
                    # Once marked, poll often: a writer that finds the turn free leaves it idle
                    # until a marked waiter's next poll.
                    delay = min(delay * 2, _TURN_MARKED_POLL_S if waiting else 0.002)
        finally:
            if waiting:
                fcntl.flock(wait_fd, fcntl.LOCK_UN)

    def _take_lock(self, conn: Connection) -> None:
        if self.backend != "sqlite":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": self._lock_key})

    def _require_schema(self) -> None:
        try:
            with self._read_engine.connect() as conn:
                present = inspect(conn).has_table(E.name, schema=self.schema)
                if present:
                    self._note_columns(conn)
        except DBAPIError as exc:
            raise classify(exc, backend=self.backend, operation="opening the audit log") from None
        if not present:
            if self.schema is None:
                raise AuditConfigError("the database holds no securetrain audit log", hint="check --db / SECURETRAIN_AUDIT_URL")
            raise AuditConfigError(f"the database holds no securetrain audit log in schema {self.schema!r}",
                                   hint="check --db / SECURETRAIN_AUDIT_URL, and --schema: the run's audit.schema")

    def _note_columns(self, conn: Connection) -> None:
        names = {c["name"] for c in inspect(conn).get_columns(E.name, schema=self.schema)}
        self._view_column = "server_view" in names
        self._write_view = self._view_column and self.backend != "sqlite"

    def _entry_select(self) -> Any:
        """SELECT of every entry column this log's table has (older tables lack server_view)."""
        return select(*(c for c in E.c if self._view_column or c.name != "server_view"))

    def _ensure_schema(self) -> None:
        upgrading = False
        try:
            with self._write_engine.begin() as conn:
                self._take_lock(conn)
                if inspect(conn).has_table(E.name, schema=self.schema):
                    self._note_columns(conn)
                    if self.backend != "sqlite" and not self._view_column:
                        # Created before server_view existed: add the column and the new insert
                        # guard in one transaction (old entries keep NULL and hash as before).
                        upgrading = True
                        for stmt in postgres_upgrade_ddl(self.schema or ""):
                            conn.exec_driver_sql(stmt.replace("%", "%%"))  # psycopg: % is a placeholder
                        self._note_columns(conn)
                    # Logs created before the index existed get it here (a non-owner skips it).
                    ensure_handover_index(conn, self.backend, self.schema)
                    return
                if self.schema:
                    conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                for table in (sqlite_tables() if self.backend == "sqlite" else TABLES):
                    table.create(conn, checkfirst=True)
                if self.backend == "sqlite":
                    stmts = sqlite_ddl()
                else:  # psycopg treats % as a placeholder even without parameters
                    stmts = [s.replace("%", "%%") for s in postgres_ddl(self.schema or "")]
                for stmt in stmts:
                    conn.exec_driver_sql(stmt)
                ensure_handover_index(conn, self.backend, self.schema, strict=True)
                self._note_columns(conn)
        except DBAPIError as exc:
            err = classify(exc, backend=self.backend, operation="creating the audit log")
            if upgrading and isinstance(err, AuditPermissionError):
                # A writer role that does not own the tables (provision_postgres) cannot upgrade them:
                # it keeps appending in the old form until the owner does; the old guard still applies.
                log.warning("audit log schema %s predates server_view and this role cannot add it; entries carry "
                            "no server-asserted view until the table owner upgrades the log (provision_postgres, "
                            "or open it once as the owner) and the writers are restarted", self.schema)
                self._view_column = self._write_view = False
                return
            raise err from None

    # -- key and identity -----------------------------------------------------------------
    @property
    def signing_key(self) -> Ed25519PrivateKey | CheckpointSigner:
        if self._signing_key is None and not self._signing_key_src and not os.environ.get("SECURETRAIN_AUDIT_KEY"):
            # Vault transit (SECURETRAIN_AUDIT_VAULT_KEY): each process builds its own client from
            # the environment, so a log sent to worker processes signs the same way there.
            self._signing_key = VaultTransitSigner.from_env()
        if self._signing_key is None:
            path = self._signing_key_src or os.environ.get("SECURETRAIN_AUDIT_KEY") or data_dir() / "audit_signing_key.pem"
            # Never created here (see audit.keys): a missing key is a configuration error.
            self._signing_key = load_signing_key(path)  # type: ignore[arg-type]
        return self._signing_key

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.signing_key.public_key()

    @property
    def origin(self) -> str:
        """Checkpoint origin and note key name; by default tied to the (first) public key.

        After a key rotation the origin stays the log's: a writer holding the new key takes it from
        the hand-over note that names its key (signed by that key, so the database cannot fake it).
        """
        if self._origin is None:
            own = self.public_key
            origin = None
            for note in reversed(self.handover_notes()):
                try:
                    ho = open_handover(note)
                except AuditIntegrityError:
                    continue
                if raw_public_key(own) in (ho.new_raw, ho.old_raw):
                    origin = ho.origin
                    break
            # A log opened elsewhere with origin= (the pipeline's "securetrain/<name>") keeps it: a
            # checkpoint under the default origin would make every later export fail verification.
            self._origin = origin or self._stored_origin() or default_origin(own)
        return self._origin

    def _stored_origin(self) -> str | None:
        """Origin of the newest stored checkpoint signed by this writer's key (or an earlier key of its chain)."""
        with self._read_engine.connect() as conn:
            for row in conn.execute(select(C.c.note).order_by(C.c.tree_size.desc())):
                origin = self._verified_origin(row.note)
                if origin is not None:
                    return origin
        return None

    def verifier_key(self) -> str:
        return verifier_key(self.origin, self.public_key)

    def public_key_pem(self) -> bytes:
        return public_key_pem(self.public_key)

    # -- writing --------------------------------------------------------------------------
    def record(
        self, action: str, resource: str, *, outcome: str = "success", details: Mapping[str, Any] | None = None
    ) -> AuditEntry | None:
        """Append one event (the ``AuditRecorder`` protocol).

        Returns the stored entry once it is durable (committed). In asynchronous mode
        (``durable=False``) it returns ``None`` as soon as the event is queued.
        """
        entries = self.append_many([(action, resource, outcome, details)])
        return entries[0] if entries else None

    def append_many(
        self, events: Sequence[tuple[str, str, str, Mapping[str, Any] | None] | Mapping[str, Any]]
    ) -> list[AuditEntry]:
        """Append a batch in one transaction: either all entries land, or none.

        Each event is ``(action, resource, outcome, details)`` or a mapping with those keys.
        """
        prepared = []
        for ev in events:
            if isinstance(ev, Mapping):
                action, resource = ev["action"], ev["resource"]
                outcome, details = ev.get("outcome", "success"), ev.get("details")
            else:
                action, resource, outcome, details = ev
            prepared.append(_prepared_event(action, resource, outcome, details))
        if not prepared:
            return []
        if not self.durable:
            return self._enqueue_async(prepared)
        req = _Pending(prepared)
        self._submit([req])
        if req.error is not None:
            raise req.error
        if req.checkpoint_error is not None:
            raise _checkpoint_failed(req.entries, req.checkpoint_error)
        return req.entries

    # -- group commit -----------------------------------------------------------------------
    def _init_group_commit(self) -> None:
        self._gc_cond = threading.Condition(threading.Lock())
        self._gc_pending: list[_Pending] = []
        self._gc_queued_events = 0  # events in _gc_pending (asynchronous mode's bound, max_queued)
        self._gc_leader = False
        self._gc_async_error: BaseException | None = None
        self._gc_flusher: threading.Thread | None = None
        self._gc_closing = False
        # Identities of other processes' requests already checked (see _pending_from_request).
        self._who_checked: set[tuple[str, str, str]] = set()

    def _submit(self, reqs: list[_Pending]) -> None:
        """Queue ``reqs`` (together, so they share a transaction) and return once each is committed
        (or failed).

        The first caller to find no commit in progress becomes the leader: it takes every request
        queued so far (after an optional bounded wait, ``group_commit_window_s``) and appends them
        all in one transaction; callers arriving meanwhile wait and form the next batch.
        """
        _fork_gate()
        cond = self._gc_cond
        server = self._server
        if server is not None and threading.current_thread() is not server.thread and server.serves():
            if self._submit_to_server(reqs, server):
                return
        else:
            with cond:
                self._gc_pending.extend(reqs)
                while self._gc_leader and not all(r.done for r in reqs):
                    cond.wait()
                if all(r.done for r in reqs):
                    return
                self._gc_leader = True
        # Lead: take everything queued, ours included (or, above, what the stopped server left).
        try:
            self._lead()
        except _CheckpointFailed as failed:
            # Our requests are committed; the checkpoint they crossed failed. Their callers are told
            # both (AuditCheckpointError), never that the append failed: a retry would record twice.
            for r in reqs:
                if r.error is None:
                    r.checkpoint_error = failed.error

    def _submit_to_server(self, reqs: list[_Pending], server: CommitServer) -> bool:
        """In the process serving this log's committer: queue ``reqs`` for the serving thread, which
        commits them in the same transaction as the other processes' appends, and wait.

        Leading here instead (as before) made this process's appends a transaction of their own
        between every two of the other processes': half the transactions held one entry (measured
        with 8 writer processes on SQLite). True once every request is done; False with
        leadership taken (``_gc_leader`` set) when the serving thread stopped first.
        """
        cond = self._gc_cond
        with cond:
            self._gc_pending.extend(reqs)
        server.kick()
        with cond:
            while not all(r.done for r in reqs):
                if not self._gc_leader and not server.serves():
                    self._gc_leader = True
                    return False
                cond.wait(0.05)
        return True

    def _lead_queued(self) -> None:
        """The serving thread, kicked by its own process: commit whatever that process queued."""
        with self._gc_cond:
            if self._gc_leader or not self._gc_pending:
                return
            self._gc_leader = True
        self._lead()

    def _lead(self) -> list[_Pending]:
        """Commit one batch as leader, then hand leadership on (caller set ``_gc_leader``)."""
        cond = self._gc_cond
        batch: list[_Pending] = []
        crossed = False
        try:
            if self.group_commit_window_s:
                time.sleep(self.group_commit_window_s)
            with self._lock:
                client = self._committer_client() if self._commit_address is not None else None
                remote: bool | None = None
                if client is not None:
                    with cond:
                        batch = self._take_queued([])
                    remote = self._commit_remote(client, batch) if batch else False
                if remote is None or client is None:
                    # SQLite: wait for the writers' turn first, then take everything queued meanwhile.
                    with self._writer_turn():
                        with cond:
                            batch = self._take_queued(batch)
                        if batch:
                            crossed = self._commit_batch(batch)
                else:
                    crossed = remote
        except BaseException as exc:  # KeyboardInterrupt while leading: fail the batch, never hang it
            for r in batch:
                if not r.done and r.error is None:
                    r.error = exc if isinstance(exc, AuditError) else AuditError(
                        f"audit append interrupted: {type(exc).__name__}", hint="nothing was recorded; retry")
            raise
        finally:
            with cond:
                for r in batch:
                    r.done = True
                if not self.durable:
                    # Asynchronous callers are gone: keep the first failure for the next call. Set
                    # before leadership is released, so a flush() that waited for this batch sees it.
                    failed = next((r.error for r in batch if r.error is not None), None)
                    if failed is not None and self._gc_async_error is None:
                        self._gc_async_error = failed
                self._gc_leader = False
                cond.notify_all()
        if crossed:
            try:
                self.checkpoint()
            except Exception as exc:  # noqa: BLE001 - the batch is committed: reported apart from it
                log.error("audit checkpoint after a committed append failed: %s", type(exc).__name__)
                error = exc if isinstance(exc, AuditError) else AuditError(
                    f"the periodic audit checkpoint failed: {type(exc).__name__}")
                raise _CheckpointFailed(error) from exc
        return batch

    def _take_queued(self, batch: list[_Pending]) -> list[_Pending]:
        """``batch`` plus the queued requests it takes on; call under ``self._gc_cond``.

        Durable mode takes them all (each is a caller waiting, the leader's own among them).
        Asynchronous mode stops once the batch holds ``_ASYNC_BATCH`` events (a request is never
        split): a flusher whose queue never empties then holds the writers' turn for one bounded
        transaction at a time, and the turn's queue lets another log's writer in between two.
        """
        pending = self._gc_pending
        if self.durable:
            self._gc_pending, self._gc_queued_events = [], 0
            return batch + pending
        n = first = sum(len(r.events) for r in batch)
        i = 0
        while i < len(pending) and n < _ASYNC_BATCH:
            n += len(pending[i].events)
            i += 1
        taken = n - first
        self._gc_pending = pending[i:]
        self._gc_queued_events = max(0, self._gc_queued_events - taken)
        if taken:
            self._gc_cond.notify_all()  # writers waiting for room (max_queued)
        return batch + pending[:i]

    def _commit_batch(self, batch: list[_Pending], prepare: Any = None) -> bool:
        """Append every request of ``batch`` in one transaction; True if a checkpoint is due.

        ``prepare(conn)``, if given, runs under the write lock and returns the events of the batch's
        only request (a key hand-over: its note signs the state it reads there).
        """
        with self._lock, self._writer_turn():
            if prepare is None and self._write_view:
                return self._pg_commit_batch(batch)
            if prepare is None and self.backend == "sqlite" and self._sqlite_file() is not None:
                return self._sqlite_commit_batch(batch)
            try:
                with self._write_engine.begin() as conn:
                    self._take_lock(conn)
                    if prepare is not None:
                        batch[0].events = prepare(conn)
                    head, view = self._head_and_view(conn)
                    view_json = None if view is None else canon.canonical_bytes_validated(view).decode()
                    start, results, cols = self._chain_batch(batch, head, view)
                    if self.backend == "sqlite":  # plain executemany: no per-row parameter processing
                        conn.exec_driver_sql(_SQLITE_INSERT, list(zip(*cols, strict=True)))
                    else:
                        rows = [dict(zip(_ROW_KEYS, values, strict=True)) for values in zip(*cols, strict=True)]
                        if view_json is not None:
                            for row in rows:
                                row["server_view"] = view_json
                        conn.execute(insert(E), rows)
            except DBAPIError as exc:
                err = classify(exc, backend=self.backend)
                for req in batch:
                    req.error = err
                return False
        return self._finish_batch(batch, results, start)

    def _finish_batch(self, batch: list[_Pending], results: list[list[AuditEntry]], start: int) -> bool:
        for req, entries in zip(batch, results, strict=True):
            req.entries = entries
        end = start + sum(len(e) for e in results)
        every = self.checkpoint_every
        return bool(every and start // every != end // every)

    def _chain_batch(
        self, batch: list[_Pending], head: Any, view: dict[str, Any] | None,
    ) -> tuple[int, list[list[AuditEntry]], tuple[list[Any], ...]]:
        """Assign seq/prev_hash/ts and hash every event of ``batch`` onto ``head``.

        Returns the first seq, the entries per request, and the stored columns (see ``_ROW_KEYS``)
        as one list per column.
        """
        seq, prev = (head.seq + 1, head.entry_hash) if head is not None else (0, canon.GENESIS_HASH)
        start = seq
        own = (self.actor, self.hostname, self.mac)
        entry_bytes, sha256, utc_timestamp = canon.entry_bytes, hashlib.sha256, canon.utc_timestamp
        view_json = None if view is None else canon.canonical_bytes_validated(view).decode()
        seqs: list[int] = []
        tss: list[str] = []
        actions: list[str] = []
        resources: list[str] = []
        outcomes: list[str] = []
        details_col: list[str] = []
        prevs: list[str] = []
        hashes: list[str] = []
        actors: list[str] = []
        hostnames: list[str] = []
        macs: list[str] = []
        results: list[list[AuditEntry]] = []
        for req in batch:
            actor, hostname, mac = req.who or own
            entries = []
            for action, resource, outcome, clean, details_json in req.events:
                ts = utc_timestamp()
                digest = sha256(entry_bytes(seq=seq, ts=ts, actor=actor, hostname=hostname, mac=mac, action=action,
                                            resource=resource, outcome=outcome, details_json=details_json,
                                            prev_hash=prev, server_view_json=view_json)).hexdigest()
                entries.append(AuditEntry(seq, ts, actor, hostname, mac, action, resource, outcome, clean, prev,
                                          digest, view))
                seqs.append(seq)
                tss.append(ts)
                actions.append(action)
                resources.append(resource)
                outcomes.append(outcome)
                details_col.append(details_json)
                prevs.append(prev)
                hashes.append(digest)
                seq, prev = seq + 1, digest
            actors += [actor] * len(entries)
            hostnames += [hostname] * len(entries)
            macs += [mac] * len(entries)
            results.append(entries)
        cols = (seqs, tss, actors, hostnames, macs, actions, resources, outcomes, details_col, prevs, hashes)
        return start, results, cols

    # -- PostgreSQL append path: two round trips per transaction ----------------------------
    def _pg_writer(self) -> Any:
        """This process's dedicated append connection (psycopg, autocommit: we send BEGIN/COMMIT).

        Kept open for the life of the log (no per-append pool checkout or pre-ping); dropped on
        any error and reopened on the next append. Used only under ``self._lock``.
        """
        if self._pg_conn is None or self._pg_conn.closed:
            import psycopg

            # Straight from the driver, with the engine's connect arguments: a first pool checkout
            # also runs the dialect's initialisation queries (~4 ms more in every new worker).
            base = self._current_engines()[2]
            assert base is not None
            cargs, cparams = base.dialect.create_connect_args(base.url)
            self._pg_conn = psycopg.connect(*cargs, **cparams, autocommit=True)
        return self._pg_conn

    def warm_up(self) -> bool:
        """Start opening this process's PostgreSQL append connection in the background; True if started.

        A new process's first append otherwise waits for its connection (about 14 ms on an idle
        machine: the server starts a backend for it). A DataLoader worker calls this when it starts
        a batch (``DicomDataset`` does), so the connection opens while the batch's files are read
        and is ready when their reads are recorded. Nothing to do on SQLite (opening takes well
        under a millisecond), when the connection is already open or being opened, or when this
        process appends through another process's committer. A failure is left to the first
        append, which reports it as usual; nothing is recorded here.
        """
        if (self.backend == "sqlite" or self._pid != os.getpid() or self._client is not None
                or self._pg_conn is not None or self._warming):
            return False
        self._warming = True

        def connect() -> None:
            try:
                with self._lock:
                    if self._pid == os.getpid() and self._pg_conn is None:
                        self._pg_writer()
            except Exception:  # noqa: BLE001 - the first append connects again and reports the error
                log.debug("audit warm-up: connecting failed; the first append retries")
            finally:
                self._warming = False

        threading.Thread(target=connect, name="securetrain-audit-warm-up", daemon=True).start()
        return True

    def _drop_pg_conn(self) -> None:
        conn, self._pg_conn = self._pg_conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already broken; nothing more to release
                pass

    def _pg_sql(self) -> tuple[str, str, str]:
        """BEGIN+lock+head; the INSERT with this log's identity as parameters; the INSERT with an
        identity per row (a batch holding other processes' events, see the shared commit)."""
        sql = self._pg_sql_cache
        if sql is None:
            table = f'"{self.schema}".{E.name}'
            # One simple-protocol message: BEGIN, the lock, then the head and the server's view. Each
            # statement takes its snapshot when it starts (READ COMMITTED), so the head is read
            # after the lock is granted and sees every earlier writer's committed entries.
            begin = (f"BEGIN; SELECT pg_advisory_xact_lock({int(self._lock_key)}); "
                     f"SELECT {SERVER_VIEW_SQL}, h.seq, h.entry_hash FROM (SELECT 1) AS one LEFT JOIN "
                     f"(SELECT seq, entry_hash FROM {table} ORDER BY seq DESC LIMIT 1) AS h ON true")
            # One statement for the whole batch: the rows travel as one JSON text (json's C encoder
            # here, PostgreSQL's parser there; far cheaper than text[] parameters), in entry order,
            # and the insert trigger checks each row as before.
            sql = self._pg_sql_cache = (begin, _pg_insert_sql(table, _PG_OWN_KEYS), _pg_insert_sql(table, _ROW_KEYS))
        return sql

    def _pg_commit_batch(self, batch: list[_Pending]) -> bool:
        """PostgreSQL append: round trip 1 sends BEGIN + lock + head/view read, round trip 2 the
        INSERT and COMMIT pipelined.

        A connection error in round trip 1 (a connection the server closed while idle) is retried
        once on a fresh connection: nothing was written (the transaction never got past its read).
        A failure in round trip 2 is never retried: whether the COMMIT landed is unknown.
        """
        import psycopg

        begin_sql, insert_own, insert_mixed = self._pg_sql()
        own = (self.actor, self.hostname, self.mac)
        mixed = any(req.who is not None and req.who != own for req in batch)
        for attempt in (0, 1):
            conn = None
            written = False
            try:
                conn = self._pg_writer()
                cur = conn.cursor()
                cur.execute(begin_sql)
                cur.nextset()
                cur.nextset()
                row = cur.fetchone()
                view = {"addr": row[1], "role": row[0], "time": row[2]}
                head = None if row[3] is None else _Head(row[3], row[4])
                start, results, cols = self._chain_batch(batch, head, view)
                view_json = canon.canonical_bytes_validated(view).decode()
                keys: tuple[str, ...]
                params: tuple[str, ...]
                if mixed:
                    keys, params = _ROW_KEYS, (view_json,)
                else:  # the identity once, as parameters: ~25% less for PostgreSQL to parse per row
                    keys, params = _PG_OWN_KEYS, (*own, view_json)
                    cols = tuple(c for k, c in zip(_ROW_KEYS, cols, strict=True) if k in _PG_OWN_KEYS)
                rows_json = _JSON_ROWS([dict(zip(keys, r, strict=True)) for r in zip(*cols, strict=True)])
                written = True
                with conn.pipeline():
                    cur.execute(insert_mixed if mixed else insert_own, (*params, rows_json))
                    cur.execute("COMMIT")
            except psycopg.Error as exc:
                lost = conn is None or conn.closed or conn.broken or isinstance(exc, psycopg.OperationalError)
                self._pg_abort(conn, lost)
                if lost and not written and attempt == 0:
                    log.info("audit append: connection to PostgreSQL lost before writing; retrying once")
                    continue
                err = classify(exc, backend=self.backend)
                for req in batch:
                    req.error = err
                return False
            except BaseException:
                self._pg_abort(conn, True)  # interrupted mid-transaction: the session state is unknown
                raise
            return self._finish_batch(batch, results, start)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- SQLite append path: the driver directly --------------------------------------------
    def _sqlite_file(self) -> str | None:
        """The database file for the direct append path; None (use the engine) for anything unusual."""
        path = self.url.split(":///", 1)[1] if ":///" in self.url else ""
        return path if path and path != ":memory:" and "?" not in path else None

    def _sqlite_writer(self) -> sqlite3.Connection:
        """This process's dedicated SQLite append connection, with the engine's pragmas.

        Through SQLAlchemy, an append spent about as long in the engine's per-statement machinery
        as in SQLite itself (profiled: ~170 us of ~590 us CPU); the transaction is the same three
        statements. Used only under ``self._lock`` and the writers' turn.
        """
        conn = self._sq_conn
        if conn is None:
            path = self._sqlite_file()
            assert path is not None
            conn = sqlite3.connect(path, timeout=self._busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            for pragma in _sqlite_pragmas(self._busy_timeout_s):
                conn.execute(pragma)
            self._sq_conn = conn
        return conn

    def _drop_sq_conn(self) -> None:
        conn, self._sq_conn = self._sq_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _sqlite_commit_batch(self, batch: list[_Pending]) -> bool:
        """SQLite append: ``BEGIN IMMEDIATE``, head, one ``executemany``, ``COMMIT`` on the driver."""
        try:
            conn = self._sqlite_writer()
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute(_SQLITE_HEAD).fetchone()
                start, results, cols = self._chain_batch(batch, None if row is None else _Head(row[0], row[1]), None)
                conn.executemany(_SQLITE_INSERT, list(zip(*cols, strict=True)))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        self._drop_sq_conn()
                raise
        except sqlite3.Error as exc:
            err = classify(exc, backend=self.backend)
            for req in batch:
                req.error = err
            return False
        return self._finish_batch(batch, results, start)

    def _pg_abort(self, conn: Any, lost: bool) -> None:
        """Roll back a failed append transaction, or drop the connection if that is not possible."""
        if conn is not None and not lost and not conn.closed:
            try:
                conn.execute("ROLLBACK")
                return
            except Exception:  # noqa: BLE001 - dropped below
                pass
        self._drop_pg_conn()

    def _head_and_view(self, conn: Connection) -> tuple[Any, dict[str, Any] | None]:
        """The last entry (seq, entry_hash; None if empty) and, on PostgreSQL, the server's view.

        One round trip per transaction, after the lock: every entry of the batch carries the same
        view, whose time lies between the transaction's start and each insert, as the trigger
        requires; and since the lock orders transactions, server times never decrease along seq.
        """
        if not self._write_view:
            head = conn.execute(select(E.c.seq, E.c.entry_hash).order_by(E.c.seq.desc()).limit(1)).first()
            return head, None
        row = conn.exec_driver_sql(  # not text(): the time format's colons would read as bind parameters
            f"SELECT {SERVER_VIEW_SQL}, h.seq, h.entry_hash FROM (SELECT 1) AS one LEFT JOIN "
            f'(SELECT seq, entry_hash FROM "{self.schema}".{E.name} ORDER BY seq DESC LIMIT 1) AS h ON true').one()
        view = {"addr": row.view_addr, "role": row.view_role, "time": row.view_time}
        return (None if row.seq is None else row), view

    # -- cross-process group commit (securetrain.audit.committer) ---------------------------
    def _committer_client(self) -> CommitClient | None:
        """This process's connection to the log's committer; None to commit here.

        None when this process serves (its own callers join its group commit directly) or when no
        committer is reachable; then it starts serving. Only logs a process opened itself take part:
        forked and unpickled copies (DataLoader, Dask and pool workers) commit their own appends —
        they may end abruptly, and their batches are already one commit each, so the extra hop
        through another process only added latency (measured on the audited DataLoader). Call
        under ``self._lock``.
        """
        if self._server is not None or self._commit_address is None:
            return None
        if self._client is not None:
            return self._client
        serving = _SERVING_HERE.get(self._commit_address)
        if serving is not None and serving is not self:
            return None  # another log object of this process serves this log: commit here (see _SERVING_HERE)
        now = time.monotonic()
        if now < self._client_retry_at:
            return None
        try:
            self._client = CommitClient(self._commit_address, timeout=self._busy_timeout_s + 30.0)
            return self._client
        except (OSError, Unprocessed):
            pass
        if self._owner and self.durable and self._pid == os.getpid():
            try:
                # Waiting for more writers pays off where a transaction has a high fixed cost (two
                # round trips, planning, the trigger's set-up: PostgreSQL), not where the serving
                # thread's own work per request dominates (SQLite's WAL commit): measured both ways.
                self._server = CommitServer(self._commit_address, self._serve_requests,
                                            linger=self.backend != "sqlite")
                _SERVING_HERE[self._commit_address] = self
                _install_exit_flush()  # stop serving (answer bye) at exit, worker exit and SIGTERM
                return None
            except OSError:  # another process started serving first: connect on the next append
                self._client_retry_at = now + 0.001
                return None
        self._client_retry_at = now + 1.0
        return None

    def _drop_client(self, retry_in: float) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
        self._client_retry_at = time.monotonic() + retry_in

    def _commit_remote(self, client: CommitClient, batch: list[_Pending]) -> bool | None:
        """Send ``batch`` to the committer: True/False (a checkpoint is due or not) once each request
        has its entries or its error; None when the committer did not process it (commit here)."""
        events = [[a, r, o, dj] for req in batch for (a, r, o, _clean, dj) in req.events]
        try:
            reply = client.call({"who": [self.actor, self.hostname, self.mac], "events": events})
        except Unprocessed:
            self._drop_client(retry_in=0.0)
            return None
        except AuditError as exc:
            self._drop_client(retry_in=0.0)
            for req in batch:
                req.error = exc
            return False
        if "error" in reply:
            err = committer.error_from_reply(reply["error"])
            for req in batch:
                req.error = err
            return False
        try:
            results = self._entries_from_reply(batch, reply)
        except AuditIntegrityError as exc:
            self._drop_client(retry_in=1.0)
            for req in batch:
                req.error = exc
            return False
        if reply.get("checkpoint_error") is not None:  # our entries are in; the committer's checkpoint failed
            checkpoint_error = committer.error_from_reply(reply["checkpoint_error"])
            for req in batch:
                req.checkpoint_error = checkpoint_error
        return self._finish_batch(batch, results, results[0][0].seq if results and results[0] else 0)

    def _entries_from_reply(self, batch: list[_Pending], reply: dict[str, Any]) -> list[list[AuditEntry]]:
        """Rebuild the stored entries from the committer's reply, re-hashing each from our own event."""
        rows, view = reply.get("entries"), reply.get("view")
        total = sum(len(req.events) for req in batch)
        malformed = AuditIntegrityError("the audit committer sent a malformed reply",
                                        hint="its entries were not accepted; see the log's tail")
        if not isinstance(rows, list) or len(rows) != total or not (view is None or isinstance(view, dict)):
            raise malformed
        try:
            view_json = None if view is None else canon.canonical_bytes_validated(view).decode()
        except AuditEventError:
            raise malformed from None
        entry_bytes, sha256 = canon.entry_bytes, hashlib.sha256
        results: list[list[AuditEntry]] = []
        it = iter(rows)
        expect_seq: int | None = None
        expect_prev: str | None = None
        for req in batch:
            entries = []
            for action, resource, outcome, clean, details_json in req.events:
                row = next(it)
                if not (isinstance(row, list) and len(row) == 4 and type(row[0]) is int
                        and all(isinstance(v, str) for v in row[1:])):
                    raise malformed
                seq, ts, prev, digest = row
                try:
                    hashed = entry_bytes(seq=seq, ts=ts, actor=self.actor, hostname=self.hostname, mac=self.mac,
                                         action=action, resource=resource, outcome=outcome, details_json=details_json,
                                         prev_hash=prev, server_view_json=view_json)
                except AuditEventError:
                    raise malformed from None
                if (sha256(hashed).hexdigest() != digest or (expect_seq is not None and seq != expect_seq)
                        or (expect_prev is not None and prev != expect_prev)):
                    raise AuditIntegrityError(
                        "the audit committer returned an entry that does not hash from this event", seq=seq,
                        hint="another process serving this log is misbehaving; its entries were not accepted")
                entries.append(AuditEntry(seq, ts, self.actor, self.hostname, self.mac, action, resource, outcome,
                                          clean, prev, digest, view))
                expect_seq, expect_prev = seq + 1, digest
            results.append(entries)
        return results

    def _serve_requests(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Commit other processes' requests in one group commit (the committer's thread)."""
        replies: list[dict[str, Any] | None] = [None] * len(requests)
        pending: list[tuple[int, _Pending]] = []
        for i, request in enumerate(requests):
            try:
                pending.append((i, self._pending_from_request(request)))
            except Exception as exc:  # noqa: BLE001 - that request's reply; the others go on
                replies[i] = committer.error_reply(exc)
        if pending:
            self._submit([req for _, req in pending])
        else:
            try:
                self._lead_queued()
            except _CheckpointFailed:  # logged by _lead; this process's callers already returned
                pass
        for i, req in pending:
            if req.error is not None:
                replies[i] = committer.error_reply(req.error)
            else:
                rows = [[e.seq, e.ts, e.prev_hash, e.entry_hash] for e in req.entries]
                reply: dict[str, Any] = {"entries": rows, "view": req.entries[0].server_view if req.entries else None}
                if req.checkpoint_error is not None:  # committed; the sender raises AuditCheckpointError
                    reply["checkpoint_error"] = committer.error_reply(req.checkpoint_error)["error"]
                replies[i] = reply
        return [r if r is not None else committer.error_reply(AuditError("not processed")) for r in replies]

    def _pending_from_request(self, request: dict[str, Any]) -> _Pending:
        """Validate another process's request exactly as a local append validates its events.

        ``details`` must arrive in the canonical form the rules give it: the sender hashes what it
        sent, so details rewritten here (a float made a string, keys reordered) would be stored and
        then refused by the sender as an entry that does not hash from its event. Such a request
        is refused instead, and nothing is stored.
        """
        who, events = request.get("who"), request.get("events")
        if not (isinstance(who, list) and len(who) == 3 and isinstance(events, list) and events):
            raise AuditEventError("malformed request to the audit committer")
        identity = (who[0], who[1], who[2])
        # The same few identities on every request: each checked once (non-text members never hashed).
        if not (all(type(v) is str for v in identity) and identity in self._who_checked):
            canon._check_text("actor", who[0], limit=256)
            canon._check_text("hostname", who[1], limit=256)
            canon._check_text("mac", who[2], limit=256)
            if len(self._who_checked) >= 1024:
                self._who_checked.clear()
            self._who_checked.add(identity)
        prepared = []
        for ev in events:
            if not (type(ev) is list and len(ev) == 4 and type(ev[3]) is str):
                raise AuditEventError("malformed event in a request to the audit committer")
            try:
                details = json.loads(ev[3])
            except ValueError:
                raise AuditEventError("the details of an event sent to the audit committer are not JSON") from None
            event = _prepared_event(ev[0], ev[1], ev[2], details)
            if event[4] != ev[3]:
                raise AuditEventError("the details of an event sent to the audit committer are not in canonical "
                                      "form; refused rather than rewritten (the sender hashes what it sent)")
            prepared.append(event)
        return _Pending(prepared, who=identity)

    def _stop_serving(self, timeout: float = 60.0) -> None:
        """Stop committing for other processes; they commit themselves or find another committer."""
        self._owner = False  # never serve again from here (an exit or SIGTERM is under way)
        server = self._server
        address = self._commit_address
        if address is not None and _SERVING_HERE.get(address) is self:
            del _SERVING_HERE[address]
        if server is not None:
            # Still set while closing: requests being committed meanwhile commit here, not through
            # a connection to this very server.
            server.close(timeout=timeout)
            self._server = None
        with contextlib.suppress(Exception):
            client, self._client = self._client, None
            if client is not None:
                client.close()

    # -- asynchronous mode (opt-in) ---------------------------------------------------------
    def _enqueue_async(self, prepared: list[tuple[Any, ...]]) -> list[AuditEntry]:
        """Queue and return; a background thread commits. Errors surface on the next call.

        Waits while ``max_queued`` events are already queued (a writer faster than the database
        would otherwise grow the queue without bound); not in the background thread itself, which
        is what empties the queue (it records an alert from ``checkpoint()``)."""
        cond = self._gc_cond
        with cond:
            if self._gc_async_error is not None:
                raise self._gc_async_error
            if self._gc_flusher is None or not self._gc_flusher.is_alive():
                _install_exit_flush()
                self._gc_flusher = threading.Thread(target=self._flusher_loop, name="securetrain-audit-flush",
                                                    daemon=True)
                self._gc_flusher.start()
            if threading.current_thread() is not self._gc_flusher:
                while self._gc_queued_events >= self.max_queued and self._gc_async_error is None:
                    cond.notify_all()
                    cond.wait(0.5)
                if self._gc_async_error is not None:
                    raise self._gc_async_error
            self._gc_pending.append(_Pending(prepared))
            self._gc_queued_events += len(prepared)
            cond.notify_all()
        return []

    def _flusher_loop(self) -> None:
        cond = self._gc_cond
        pid = os.getpid()
        while pid == os.getpid():
            _fork_gate()
            with cond:
                while not self._gc_pending or self._gc_leader:
                    if self._gc_closing and not self._gc_pending:
                        return
                    cond.wait(0.5)
                self._gc_leader = True
            try:
                self._lead_async()
            except BaseException:  # noqa: BLE001 - recorded in _gc_async_error by _lead_async
                pass

    def _lead_async(self) -> None:
        try:
            batch = self._lead()
        except BaseException as exc:  # noqa: BLE001
            with self._gc_cond:
                if isinstance(exc, _CheckpointFailed):  # committed; the checkpoint after it failed
                    self._gc_async_error = self._gc_async_error or exc.error
                else:
                    self._gc_async_error = exc if isinstance(exc, AuditError) else AuditError(
                        f"asynchronous audit flush failed: {type(exc).__name__}")
            raise
        failed = next((r.error for r in batch if r.error is not None), None)
        if failed is not None:  # kept by _lead: it fails every later call, never dropped silently
            log.error("asynchronous audit append failed: %s", failed)

    def flush(self) -> None:
        """Commit everything queued (asynchronous mode) and raise the first asynchronous failure."""
        cond = self._gc_cond
        while True:
            with cond:
                while self._gc_leader:
                    cond.wait()
                if not self._gc_pending:
                    err = self._gc_async_error
                    break
                self._gc_leader = True
            try:
                batch = self._lead()
            except _CheckpointFailed as exc:  # what was queued is committed; the checkpoint failed
                raise exc.error from exc.__cause__
            failed = next((r.error for r in batch if r.error is not None), None)
            if failed is not None:
                with cond:
                    self._gc_async_error = self._gc_async_error or failed
        if err is not None:
            raise err

    # -- reading --------------------------------------------------------------------------
    def size(self) -> int:
        with self._read_engine.connect() as conn:
            head = conn.execute(select(E.c.seq).order_by(E.c.seq.desc()).limit(1)).first()
        return 0 if head is None else head.seq + 1

    def _rows(self, conn: Connection, start: int, stop: int | None) -> Iterator[Any]:
        cursor = start
        while True:
            q = self._entry_select().where(E.c.seq >= cursor).order_by(E.c.seq).limit(_BATCH)
            if stop is not None:
                q = q.where(E.c.seq < stop)
            batch = conn.execute(q).all()
            yield from batch
            if len(batch) < _BATCH:
                return
            cursor = batch[-1].seq + 1

    def entries(self, start: int = 0, stop: int | None = None) -> Iterator[AuditEntry]:
        """Entries in ``seq`` order (read in one snapshot)."""
        with self._read_engine.connect() as conn:
            for row in self._rows(conn, start, stop):
                yield _entry_from_row(row)[0]

    def tail(self, n: int) -> list[AuditEntry]:
        with self._read_engine.connect() as conn:
            rows = conn.execute(self._entry_select().order_by(E.c.seq.desc()).limit(n)).all()
        return [_entry_from_row(r)[0] for r in reversed(rows)]

    def checkpoints(self) -> list[Checkpoint]:
        with self._read_engine.connect() as conn:
            rows = conn.execute(select(C).order_by(C.c.tree_size)).all()
        out = []
        for r in rows:
            try:
                origin, size, root = parse_checkpoint_text(parse_note(r.note)[0])
            except Exception:  # noqa: BLE001 - a malformed row is reported by verify(), not here
                log.error("audit checkpoint row at size %s is malformed (ignored)", r.tree_size)
                continue
            out.append(Checkpoint(origin, size, root, r.note))
        return out

    def latest_checkpoint(self) -> Checkpoint | None:
        cps = self.checkpoints()
        return cps[-1] if cps else None

    def _leaf_hashes(self, conn: Connection, stop: int) -> list[bytes]:
        return [leaf_hash(_entry_from_row(r)[0].hashed_bytes()) for r in self._rows(conn, 0, stop)]

    # -- checkpoints and proofs -----------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """Sign the current tree head (idempotent if nothing was appended) and publish it.

        In asynchronous mode everything queued is committed first, so the checkpoint covers it.
        Before signing, the tree must reproduce the newest checkpoint that verifies with this
        log's key among those *published* to the anchors and those stored in the database, so
        someone who can rewrite the database (rows and checkpoints) cannot make the writer sign a
        forged history; the writer refuses (:class:`AuditIntegrityError`) and logs an alert.
        """
        if not self.durable:
            self.flush()
        origin = self.origin  # the log's, unchanged by a rotation
        self._key_chain()  # which keys' checkpoints are references; refuses a retired key
        stored_origin = self._stored_origin()
        if stored_origin is not None and stored_origin != origin:
            # Verifiers refuse a log whose checkpoints name two origins, and a signed checkpoint
            # cannot be removed: refuse before signing instead of breaking every later export.
            raise AuditConfigError(
                f"this log's checkpoints are signed for origin {stored_origin!r}, not the configured {origin!r}",
                hint=f"open the log without origin= (it is taken from its checkpoints) or with origin={stored_origin!r}")
        published = self._published_reference()
        for _attempt in range(2):
            with self._lock, self._writer_turn():
                # The key is read under the lock: rotate_key switches it under the same lock as it
                # commits the hand-over, so this checkpoint is signed by the key that the chain
                # below holds current (read before, a checkpoint racing a rotation was signed by the
                # just-retired key: seen from the shared committer's periodic checkpoint).
                key = self.signing_key
                with self._write_engine.begin() as conn:
                    self._take_lock(conn)
                    head = conn.execute(select(E.c.seq).order_by(E.c.seq.desc()).limit(1)).first()
                    size = 0 if head is None else head.seq + 1
                    self._key_chain(conn, size)  # a hand-over committed meanwhile retires our key
                    stored = self._newest_valid_stored(conn)
                    refs = {ref[0]: ref[1] for ref in (stored, published) if ref is not None}
                    if max(refs, default=0) > size:
                        big = max(refs)
                        log.critical("audit log %s has %d entries but checkpoint %d was signed: refusing to sign",
                                     self.schema or self.url, size, big)
                        raise AuditIntegrityError(
                            f"the log has {size} entries but checkpoint {big} was signed"
                            f"{' and published' if published and published[0] == big else ''}: entries were deleted",
                            seq=size, problem="truncated", hint="run 'securetrain audit verify' against the anchors")
                    taken = conn.execute(select(C).where(C.c.tree_size == size)).first()
                    if taken is not None:
                        if stored is not None and stored[0] == size:  # ours and valid: idempotent
                            self._extend_cache(conn, size, refs)
                            o, s_, r = parse_checkpoint_text(parse_note(taken.note)[0])
                            return Checkpoint(o, s_, r, taken.note)
                        # A row at this size that does not verify was inserted without the key.
                        # Record that in the chain, which also makes a fresh size to sign.
                        pass
                    else:
                        self._extend_cache(conn, size, refs)
                        cp = sign_checkpoint(origin, size, self._cache.root(), origin, key)
                        try:
                            conn.execute(insert(C), [{"tree_size": size, "root_hash": cp.root_hash.hex(),
                                                       "created_at": canon.utc_timestamp(), "note": cp.note}])
                        except DBAPIError as exc:
                            raise classify(exc, backend=self.backend, operation="storing a checkpoint") from None
                        break
            log.error("audit checkpoint row at size %d does not verify with the log key; recording an alert", size)
            self.record("audit.alert", f"checkpoint:{size}",
                        outcome="failure", details={"problem": "unverifiable checkpoint row", "tree_size": size})
        else:
            raise AuditIntegrityError("could not sign a checkpoint: unverifiable checkpoint rows keep appearing",
                                      problem="checkpoint-row", hint="run 'securetrain audit verify'")
        for anchor in self.anchors:
            anchor.publish(cp)
        return cp

    def check_signing_key(self) -> None:
        """Refuse (:class:`AuditConfigError`) a writer whose key cannot continue this log's signatures.

        When the log holds signed checkpoints and none verifies with this writer's key (or a key it
        took over from by a hand-over), its checkpoints would start a second history of signatures
        that no verifier accepts: typically a run's own demo key on a log shared by many runs.
        ``checkpoint()`` alone would sign anyway (an unverifiable row may be a forgery inserted
        without the key, which must not stop the real writer); call this where a wrong key is a
        configuration error, before anything is appended (the pipeline does, for shared logs).
        """
        self._key_chain()  # also refuses a retired key; the chain _stored_origin checks notes with
        if self._stored_origin() is not None:  # a checkpoint of ours (newest first: usually the first read)
            return
        with self._read_engine.connect() as conn:
            foreign = conn.execute(select(func.count()).select_from(C)).scalar_one()
        if not foreign:
            return
        raise AuditConfigError(
            f"this audit log's {foreign} signed checkpoint(s) were signed by another key than this writer's: "
            "its checkpoints would start a second history of signatures that no verifier accepts",
            hint="give every writer of the log the same signing key (audit.signing_key or SECURETRAIN_AUDIT_KEY; a "
                 "run's demo key under its keys folder is a new key per run), or have the current key's holder hand "
                 "the log over with 'securetrain audit rotate-key'")

    def _published_reference(self) -> tuple[int, bytes] | None:
        """(size, root) of the newest checkpoint published to the anchors that verifies with our key."""
        best: tuple[int, bytes] | None = None
        for anchor in self.anchors:
            try:
                notes = anchor.notes()
            except Exception as exc:  # noqa: BLE001 - an unreadable anchor must not be skipped silently
                raise AuditError(f"cannot read the published checkpoints of anchor {anchor!r}: {type(exc).__name__}",
                                 hint="the writer checks new checkpoints against published ones; fix the anchor") from None
            for note in notes:
                ref = self._verified_ref(note)
                if ref is not None and (best is None or ref[0] > best[0]):
                    best = ref
        return best

    def _verified_origin(self, note: str) -> str | None:
        chain = self._chain or writer_chain(self.public_key, [])[0]
        try:
            return open_with_chain(note, chain)[0]
        except Exception:  # noqa: BLE001 - another key's or a malformed note says nothing about our origin
            return None

    def _verified_ref(self, note: str) -> tuple[int, bytes] | None:
        """(size, root) of a checkpoint signed by our key, or by an earlier key within its hand-over size."""
        chain = self._chain or writer_chain(self.public_key, [])[0]
        try:
            _o, size, root = open_with_chain(note, chain)
        except Exception:  # noqa: BLE001 - another key's or a malformed note is not a reference
            return None
        return size, root

    # -- key rotation ---------------------------------------------------------------------
    def _scan_handovers(self, conn: Connection | None = None, size: int | None = None) -> list[tuple[int, str]]:
        """(seq, note) of every ``audit.key_rotated`` entry below ``size`` (searched incrementally)."""
        with self._lock:
            if conn is None or size is None:
                with self._read_engine.connect() as c:
                    head = c.execute(select(E.c.seq).order_by(E.c.seq.desc()).limit(1)).first()
                    return self._scan_handovers(c, 0 if head is None else head.seq + 1)
            if size > self._ho_scanned:
                # Entries commit in seq order under the write lock, so every row below size is visible.
                rows = conn.execute(handover_rows_query(self._ho_scanned, size))
                for row in rows:
                    try:
                        note = handover_note_of(json.loads(row.details))
                    except (TypeError, json.JSONDecodeError):
                        note = None
                    if note is not None:
                        self._ho_notes.append((row.seq, note))
                self._ho_scanned = size
            return list(self._ho_notes)

    def handover_notes(self, stop: int | None = None) -> list[str]:
        """The key hand-over notes recorded in entries ``0 .. stop-1`` (all by default), oldest first."""
        return [note for seq, note in self._scan_handovers() if stop is None or seq < stop]

    def _key_chain(self, conn: Connection | None = None, size: int | None = None) -> KeyChain:
        chain, retired = writer_chain(self.public_key, [n for _, n in self._scan_handovers(conn, size)])
        if retired is not None:
            log.critical("audit signing key %s was retired by a hand-over at size %d; refusing to sign",
                         retired.old_vkey.split("+")[1], retired.tree_size)
            raise AuditConfigError(
                f"this writer's audit key was retired at tree size {retired.tree_size} by a hand-over to "
                f"{retired.new_vkey}: it must not sign checkpoints any more",
                hint="configure the new key (SECURETRAIN_AUDIT_KEY or signing_key=) on every writer")
        self._chain = chain
        return chain

    def rotate_key(self, new_key: Ed25519PrivateKey | CheckpointSigner | str | os.PathLike[str]) -> Handover:
        """Hand the log over to ``new_key`` and sign from now on with it.

        Signs a checkpoint with the current key, then, under the log's write lock, records an
        ``audit.key_rotated`` entry whose ``details.note`` is the hand-over note (origin, the newest
        checkpoint's size and root, old and new verifier keys; signed by the old key and by the new
        one), switches to the new key and signs a checkpoint with it. Other writers still holding
        the old key refuse to sign from then on (:class:`AuditConfigError`); give them the new key.
        """
        new = new_key if isinstance(new_key, (Ed25519PrivateKey, CheckpointSigner)) else load_signing_key(new_key)
        old = self.signing_key
        old_raw, new_raw = raw_public_key(old.public_key()), raw_public_key(new.public_key())
        if old_raw == new_raw:
            raise AuditConfigError("the new audit key is the same key as the current one: a rotation needs a different key",
                                   hint="create one with 'securetrain audit keygen --out NEW.pem'")
        origin = self.origin
        self.checkpoint()  # the old key's last checkpoint, after the usual consistency checks
        made: list[Handover] = []

        def prepare(conn: Connection) -> list[tuple[Any, ...]]:
            head = conn.execute(select(E.c.seq).order_by(E.c.seq.desc()).limit(1)).first()
            chain = self._key_chain(conn, 0 if head is None else head.seq + 1)
            if new_raw in chain.windows or any(open_handover(n).old_raw == new_raw
                                               for _, n in self._ho_notes if _opens(n)):
                raise AuditConfigError("the new audit key was already used by this log",
                                       hint="rotate to a freshly generated key")
            stored = self._newest_valid_stored(conn)
            if stored is None:
                raise AuditIntegrityError("no valid checkpoint to hand over at", problem="checkpoint-row",
                                          hint="run 'securetrain audit verify'")
            size, root = stored
            note = sign_handover(origin, size, root, old_name=origin, old_key=old, new_name=origin, new_key=new)
            ho = open_handover(note)
            made.append(ho)
            details = canon.validate_details({
                "note": note, "tree_size": size, "old_key_id": ho.old_vkey.split("+")[1],
                "new_key_id": ho.new_vkey.split("+")[1]})
            return [(ROTATION_ACTION, f"audit-key:{origin}", "success", details, canon.canonical_bytes(details).decode())]

        req = _Pending([])
        with self._lock:  # the hand-over entry and the switch, as one step for checkpoint()
            self._commit_batch([req], prepare=prepare)
            if req.error is not None:
                raise req.error
            self._signing_key = new
            self._signing_key_src = new_key
            self._reopen_args["signing_key"] = new_key
            self._chain = None
        log.warning("audit signing key handed over at tree size %d to %s", made[0].tree_size, made[0].new_vkey)
        self.checkpoint()  # the new key's first checkpoint covers the hand-over entry
        return made[0]

    def _newest_valid_stored(self, conn: Connection) -> tuple[int, bytes] | None:
        """Newest stored checkpoint that verifies with our key (bogus rows are skipped and logged)."""
        for row in conn.execute(select(C.c.tree_size, C.c.note).order_by(C.c.tree_size.desc())):
            ref = self._verified_ref(row.note)
            if ref is not None and ref[0] == row.tree_size:
                return ref
            log.error("audit checkpoint row at size %d does not verify with the log key (ignored)", row.tree_size)
        return None

    def _extend_cache(self, conn: Connection, size: int, refs: Mapping[int, bytes]) -> None:
        """Grow the cached tree to ``size`` leaves, refusing to sign a history that was rewritten.

        The signing key must not become an oracle for someone who can only write the database:
        every new row must chain onto the cached head, and the tree must reproduce every reference
        checkpoint (the newest stored and the newest published one, signatures checked with our
        own key) at its size.
        """
        pending = {n: r for n, r in refs.items() if (n, r) not in self._cache_checked}
        if pending and self._cache.size > min(pending):  # cannot be checked any more: rebuild
            self._reset_cache()

        def check_here() -> None:
            want = pending.get(self._cache.size)
            if want is None:
                return
            if self._cache.root() != want:
                n = self._cache.size
                self._reset_cache()
                log.critical("audit log rewritten: first %d entries no longer match a signed checkpoint", n)
                raise AuditIntegrityError(f"the first {n} entries no longer match the signed checkpoint; "
                                          "refusing to sign a rewritten history", seq=n - 1 if n else None,
                                          problem="checkpoint-root", hint="run 'securetrain audit verify'")
            self._cache_checked.add((self._cache.size, want))

        check_here()
        for row in self._rows(conn, self._cache.size, size):
            entry = _entry_from_row(row)[0]
            raw = entry.hashed_bytes()
            if row.seq != self._cache.size or entry.prev_hash != self._cache_head or canon.sha256_hex(raw) != entry.entry_hash:
                self._reset_cache()
                log.critical("audit log entry seq=%s does not chain onto the signed history", row.seq)
                raise AuditIntegrityError(f"entry seq={row.seq} does not chain onto the signed history; refusing to "
                                          "sign a checkpoint", seq=row.seq, problem="prev_hash",
                                          hint="the database was modified; run 'securetrain audit verify'")
            self._cache.append(leaf_hash(raw))
            self._cache_head = entry.entry_hash
            check_here()
        if self._cache.size != size:
            n = self._cache.size
            self._reset_cache()
            raise AuditIntegrityError(f"expected {size} entries, read {n}", seq=n, problem="truncated")

    def _reset_cache(self) -> None:
        self._cache, self._cache_head, self._cache_checked = CompactRange(), canon.GENESIS_HASH, set()

    def inclusion_proof(self, seq: int, tree_size: int | None = None) -> dict[str, Any]:
        """RFC 6962 inclusion proof of entry ``seq`` in the tree of ``tree_size`` (default: latest checkpoint)."""
        if tree_size is None:
            cp = self.latest_checkpoint()
            tree_size = cp.tree_size if cp else self.size()
        with self._read_engine.connect() as conn:
            leaves = self._leaf_hashes(conn, tree_size)
            row = conn.execute(self._entry_select().where(E.c.seq == seq)).first()
        if len(leaves) != tree_size:
            raise AuditError(self._beyond_log(tree_size, len(leaves), f"cannot prove entry {seq}"))
        if row is None or not 0 <= seq < tree_size:
            raise AuditError(f"cannot prove entry {seq}: it is not among entries 0..{tree_size - 1} of tree size "
                             f"{tree_size} (the size proven against){self._log_size_note(tree_size)}")
        entry = _entry_from_row(row)[0]
        return {
            "seq": seq, "tree_size": tree_size, "leaf_index": seq,
            "entry": entry.hashed_bytes().decode(), "leaf_hash": leaves[seq].hex(),
            "root_hash": root_hash(leaves).hex(), "proof": [p.hex() for p in inclusion_proof(seq, leaves)],
        }

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> dict[str, Any]:
        """RFC 6962 consistency proof from the tree of ``old_size`` (at least 1) to ``new_size``
        (default: the log's size)."""
        if old_size < 1:
            raise AuditError(f"cannot prove {old_size} -> {new_size}: {NO_PROOF_FROM_EMPTY_TREE}; the old size must be "
                             "at least 1")
        new_size = self.size() if new_size is None else new_size
        with self._read_engine.connect() as conn:
            leaves = self._leaf_hashes(conn, new_size)
        if len(leaves) != new_size:
            raise AuditError(self._beyond_log(new_size, len(leaves), f"cannot prove {old_size} -> {new_size}"))
        if old_size > new_size:
            raise AuditError(f"cannot prove {old_size} -> {new_size}: the old size is larger than the tree size "
                             f"{new_size} (the size proven against){self._log_size_note(new_size)}")
        return {
            "old_size": old_size, "new_size": new_size, "old_root": root_hash(leaves[:old_size]).hex(),
            "new_root": root_hash(leaves).hex(), "proof": [p.hex() for p in consistency_proof(old_size, leaves)],
        }

    def _log_size_note(self, tree_size: int) -> str:
        """'; the log has N entries' where the log's size is not the size proven against."""
        size = self.size()
        return "" if size == tree_size else f"; the log has {size} entries"

    @staticmethod
    def _beyond_log(tree_size: int, read: int, what: str) -> str:
        return (f"{what}: tree size {tree_size} (the size proven against) is larger than the log; "
                f"the log has only {read} entries")

    def handover_proofs(self, tree_size: int) -> list[dict[str, Any]]:
        """What a proof at ``tree_size`` needs to follow a key rotation offline.

        One ``{"note", "consistency"}`` per hand-over recorded in entries ``0 .. tree_size-1``
        (oldest first): the hand-over note and the RFC 6962 consistency proof from its size to
        ``tree_size``, so a verifier that trusts the old key accepts the new key's checkpoint and
        checks that the proven tree extends the one the old key handed over.
        """
        notes = self.handover_notes(tree_size)
        if not notes:
            return []  # no rotation below this size: no need to read the leaves
        with self._read_engine.connect() as conn:
            leaves = self._leaf_hashes(conn, tree_size)
        if len(leaves) != tree_size:
            raise AuditError(f"cannot prove hand-overs in a tree of size {tree_size}: log has {len(leaves)} entries")
        out = []
        for note in notes:
            size = open_handover(note).tree_size
            out.append({"note": note, "consistency": [p.hex() for p in consistency_proof(size, leaves)]})
        return out

    # -- verification and export ----------------------------------------------------------
    def _row_batches(self) -> Iterator[list[tuple[Any, ...]]]:
        """Every entry row in ``seq`` order, in batches, as :func:`verify_rows` takes them: the
        template's columns, the stored hash, the server view text (None without the column), and
        the row itself (for :meth:`_record_from_row`)."""
        columns: Any = None
        view_at: int | None = None
        with self._read_engine.connect() as conn:
            batch: list[tuple[Any, ...]] = []
            for row in self._rows(conn, 0, None):
                if columns is None:  # positions looked up once (attribute access per row is slow)
                    names = row._fields
                    columns = operator.itemgetter(*(names.index(n) for n in _TEMPLATE_COLUMNS))
                    view_at = names.index("server_view") if "server_view" in names else None
                batch.append((*columns(row), None if view_at is None else row[view_at], row))
                if len(batch) >= _BATCH:
                    yield batch
                    batch = []
            if batch:
                yield batch

    def _record_from_row(self, row: Any) -> Record:
        """The exact path for one row: parsed and re-encoded canonically (slow, names every problem)."""
        view_text = row.server_view if "server_view" in row._fields else None
        # Stored details (and server view) canonical, float-free, I-JSON integers: the entry's bytes
        # come from the C encoder and need no second check.
        details = canon.parse_canonical_object(row.details) if isinstance(row.details, str) else None
        view = None if view_text is None else canon.parse_canonical_object(view_text)
        if details is not None and (view_text is None or view is not None):
            fast = AuditEntry(row.seq, row.ts, row.actor, row.hostname, row.mac, row.action, row.resource,
                              row.outcome, details, row.prev_hash, row.entry_hash, view).hashed_object()
            if _plain_fields(fast):
                return Record(canon.canonical_bytes_validated(fast), fast, stored_hash=row.entry_hash,
                              stored_seq=row.seq, canonical=True)
        entry, details_text = _entry_from_row(row)
        obj = entry.hashed_object()
        try:
            raw = entry.hashed_bytes()
            if canon.canonical_bytes(entry.details).decode() != details_text:
                obj = {**obj, "details": {"__stored_details_not_canonical__": True}}
            if entry.server_view is not None and canon.canonical_bytes(entry.server_view).decode() != view_text:
                obj = {**obj, "server_view": {"__stored_server_view_not_canonical__": True}}
        except AuditEventError:  # a tampered row with no canonical form: let the verifier name it
            raw, obj = b"", {**obj, "details": {"__stored_details_not_canonical__": True}}
        return Record(raw, obj, stored_hash=row.entry_hash, stored_seq=row.seq)

    def verify(
        self, *, trusted_checkpoints: Sequence[str] = (),
        public_key: Ed25519PublicKey | Sequence[Ed25519PublicKey] | None = None,
        on_entry: Any = None,
    ) -> VerifyReport:
        """Recompute every hash, the Merkle root at each checkpoint and all signatures.

        ``public_key`` defaults to this log's own key; pass an independently held one to detect a
        database re-signed with a different key. ``trusted_checkpoints`` are notes kept elsewhere.
        """
        handovers = self.handover_notes()  # every one recorded: one that does not link fails verification
        key = public_key if public_key is not None else root_key(self.public_key, handovers)
        with self._read_engine.connect() as conn:  # raw notes: a malformed row is reported, not raised
            notes = [r.note for r in conn.execute(select(C.c.note).order_by(C.c.tree_size))]
        return verify_rows(self._row_batches(), self._record_from_row, public_key=key, checkpoint_notes=notes,
                              trusted_notes=trusted_checkpoints, on_entry=on_entry, handover_notes=handovers)

    def export(self, outdir: str | os.PathLike[str], *, checkpoint: bool = True) -> Path:
        from securetrain.audit.export import export_log

        return export_log(self, outdir, checkpoint=checkpoint)

    # -- pickling: DataLoader workers and process pools reopen the log by URL -------------
    def __getstate__(self) -> dict[str, Any]:
        if isinstance(self._reopen_args["signing_key"], (Ed25519PrivateKey, CheckpointSigner)):
            raise AuditConfigError(
                "an AuditLog holding an in-memory signing key cannot be sent to another process",
                hint="open the log with signing_key=<path to the PEM file> instead",
            )
        # Database handles and locks never cross processes; the child opens its own engines, and
        # the database lock (BEGIN IMMEDIATE / advisory lock) keeps the chain linear across them.
        return {"url": self.url, "args": self._reopen_args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], create=False, **state["args"])  # type: ignore[misc]
        # A worker's copy (spawn DataLoader, Dask, process pools) commits its own appends, as a forked one.
        self._owner, self._commit_address = False, None

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Flush queued asynchronous entries (raising if they cannot be stored), then release connections."""
        if self._pid == os.getpid():
            self._stop_serving()
        try:
            if not self.durable and self._pid == os.getpid():
                with self._gc_cond:
                    self._gc_closing = True
                    self._gc_cond.notify_all()
                self.flush()
        finally:
            # Closed even when the flush failed (the caller got the error): the exit hook must not
            # retry it into a closed console, and the connections are released either way.
            self._closed = True
            self._release_engines()

    def _release_engines(self) -> None:
        if self._pid != os.getpid():
            self._forget_inherited_state()
            return
        self._drop_pg_conn()
        self._drop_sq_conn()
        if self._turn_fd is not None and self._turn_depth == 0:
            with contextlib.suppress(OSError):
                os.close(self._turn_fd)
            self._turn_fd = None
            if self._wait_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._wait_fd)
                self._wait_fd = None
        engines, self._engines = self._engines, None
        if engines is None:
            return
        for engine in {id(e): e for e in engines if e is not None}.values():
            engine.dispose()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Head:
    seq: int
    entry_hash: str


#: Stored columns of an entry as built by ``AuditLog._chain_batch`` (``server_view`` apart).
_ROW_KEYS = ("seq", "ts", "actor", "hostname", "mac", "action", "resource", "outcome", "details", "prev_hash",
             "entry_hash")
#: How long a writer that finds the SQLite writers' turn free leaves it to writers of other processes
#: already waiting (see ``AuditLog._take_turn_lock``): longer than their longest poll interval (2 ms),
#: short enough that a waiter that stopped polling (stopped, not killed) costs little.
_TURN_COURTESY_S = 0.01
#: How long a writer polls for the turn before it marks itself as waiting (others then let it in
#: first): a wait that short is ordinary contention, where taking turns by chance keeps the turn
#: busy (marking every wait left the turn idle between writers: 8 processes committing their own
#: appends slowed from 2.6k to 1.6k/s); a longer one is the starvation this prevents.
_TURN_ESCALATE_S = 0.025
#: A marked waiter's longest poll interval: the turn stays idle until its next poll when a writer
#: leaves it to marked waiters (0.1 ms cost more CPU, 2 ms more idle turn; both measured slower).
_TURN_MARKED_POLL_S = 0.0003


def _sqlite_pragmas(busy_timeout_s: float) -> tuple[str, ...]:
    """Every SQLite connection of the log (engine and direct append path) runs these on open."""
    return ("PRAGMA journal_mode=WAL",  # readers do not block the writer
            "PRAGMA synchronous=FULL",  # a returned append is durable
            "PRAGMA recursive_triggers=ON",
            f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")


_SQLITE_HEAD = f"SELECT seq, entry_hash FROM {E.name} ORDER BY seq DESC LIMIT 1"  # nosec B608 - constant
_SQLITE_INSERT = (f"INSERT INTO {E.name} ({', '.join(_ROW_KEYS)}) "  # nosec B608 - constant names
                  f"VALUES ({', '.join('?' * len(_ROW_KEYS))})")


#: The PostgreSQL append sends the rows (``_ROW_KEYS``) as JSON (see ``AuditLog._pg_sql``). Strings
#: are validated text (no lone surrogates) and round-trip exactly through JSON; ensure_ascii=False
#: keeps them UTF-8 so PostgreSQL never has to decode \\u escapes.
_PG_OWN_KEYS = ("seq", "ts", "action", "resource", "outcome", "details", "prev_hash", "entry_hash")


def _pg_insert_sql(table: str, json_keys: tuple[str, ...]) -> str:
    """INSERT of a batch whose rows travel as one JSON array with ``json_keys`` per row; every
    other column of ``_ROW_KEYS`` (the writer's identity, for a batch of this log's own events) is
    one ``%s`` parameter for the whole batch, in ``_ROW_KEYS`` order, then ``server_view``, then
    the JSON. Parameters: ``(*other columns, server_view, rows_json)``."""
    values = ", ".join(f"u.{k}" if k in json_keys else "%s" for k in _ROW_KEYS)
    record = ", ".join(f"{k} {'bigint' if k == 'seq' else 'text'}" for k in json_keys)
    return (f"INSERT INTO {table} ({', '.join(_ROW_KEYS)}, server_view) SELECT {values}, %s "
            f"FROM json_to_recordset(%s::json) AS u({record})")


_JSON_ROWS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode


def _prepared_event(action: Any, resource: Any, outcome: Any, details: Any) -> tuple[str, str, str, dict[str, Any], str]:
    """An event validated for appending: (action, resource, outcome, clean details, canonical JSON)."""
    canon.validate_event(action, resource, outcome)
    clean, details_bytes = canon.validated_details(details)
    return action, resource, outcome, clean, details_bytes.decode()


class _CheckpointFailed(Exception):
    """Raised by ``_lead`` when its batch is committed but the checkpoint due after it failed
    (``error``); never leaves the log: callers get :class:`AuditCheckpointError`."""

    def __init__(self, error: AuditError) -> None:
        super().__init__(str(error))
        self.error = error


def _checkpoint_failed(entries: list[AuditEntry], cause: AuditError) -> AuditCheckpointError:
    first = f"seq {entries[0].seq}" if entries else "the entries"
    err = AuditCheckpointError(
        f"audit entries recorded ({first}, {len(entries)} in all; do not append them again), but the checkpoint "
        f"due after them failed: {type(cause).__name__}: {cause.args[0] if cause.args else ''}",
        entries=entries, hint=cause.hint or "run 'securetrain audit verify'; the next checkpoint is tried again")
    err.__cause__ = cause
    return err


class _Pending:
    """One caller's events waiting for a group commit."""

    __slots__ = ("events", "who", "entries", "error", "done", "checkpoint_error")

    def __init__(self, events: list[tuple[Any, ...]], who: tuple[str, str, str] | None = None) -> None:
        self.events = events
        self.who = who  # (actor, hostname, mac) of another process served by this one; None: this log's
        self.entries: list[AuditEntry] = []
        self.error: BaseException | None = None
        self.done = False
        # Committed, but the checkpoint this caller's append was due to sign failed (see _lead).
        self.checkpoint_error: AuditError | None = None


def handover_rows_query(start: int, stop: int) -> Any:
    """``(seq, details)`` of the ``audit.key_rotated`` entries with ``start <= seq < stop``, by seq.

    The action is a literal, not a bound parameter, so the planner matches the partial index's
    predicate (see :mod:`securetrain.audit.indexes`).
    """
    return select(E.c.seq, E.c.details).where(
        E.c.action == literal_column(HANDOVER_ACTION_SQL), E.c.seq >= start, E.c.seq < stop).order_by(E.c.seq)


def _opens(note: str) -> bool:
    try:
        open_handover(note)
    except AuditIntegrityError:
        return False
    return True


class _TurnQueue:
    """A FIFO lock with direct hand-over: the writers' turn of one database among this process's threads.

    ``release`` passes the turn to the oldest waiter before anyone else can take it, so a writer
    that re-acquires at once (an asynchronous flusher) queues behind those already waiting instead
    of winning the race again. Uncontended, ``acquire`` and ``release`` take one internal lock each.
    """

    __slots__ = ("_mutex", "_held", "_waiters", "__weakref__")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: collections.deque[threading.Lock] = collections.deque()

    def acquire(self, deadline: float) -> bool:
        """Take the turn, waiting in line until ``deadline`` (``time.monotonic()``); False if it passed."""
        with self._mutex:
            if not self._held:  # free means nobody waits: release() hands over while anyone does
                self._held = True
                return True
            ticket = threading.Lock()
            ticket.acquire()
            self._waiters.append(ticket)
        try:
            if ticket.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return True  # handed over by release(): the turn is ours
        except BaseException:  # interrupted while waiting: leave the line, or pass on a turn handed to us
            with self._mutex:
                try:
                    self._waiters.remove(ticket)
                    handed = False
                except ValueError:
                    handed = True
            if handed:
                self.release()
            raise
        with self._mutex:
            try:
                self._waiters.remove(ticket)
            except ValueError:  # handed over between the timeout and here: ours after all
                return True
            return False

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # stays held: now the oldest waiter's
            else:
                self._held = False


#: Turn file path -> this process's queue for it, shared by every log object on that database.
_TURN_QUEUES: weakref.WeakValueDictionary[str, _TurnQueue] = weakref.WeakValueDictionary()
_TURN_QUEUES_LOCK = threading.Lock()
_TURN_QUEUES_PID = os.getpid()


def _turn_queue_for(path: str) -> _TurnQueue:
    """This process's queue for the turn file ``path`` (a forked child starts with none)."""
    if _TURN_QUEUES_PID != os.getpid():  # forked without the at-fork hook having run (defensive)
        _reset_turn_queues()
    with _TURN_QUEUES_LOCK:
        queue = _TURN_QUEUES.get(path)
        if queue is None:
            queue = _TURN_QUEUES[path] = _TurnQueue()
        return queue


def _reset_turn_queues() -> None:
    """In a forked child: the parent's queues (and their locks) are never used here."""
    global _TURN_QUEUES, _TURN_QUEUES_LOCK, _TURN_QUEUES_PID
    _TURN_QUEUES = weakref.WeakValueDictionary()
    _TURN_QUEUES_LOCK = threading.Lock()
    _TURN_QUEUES_PID = os.getpid()


#: Every open log in this process, so the at-fork hook can reset them in the child.
_LIVE_LOGS: weakref.WeakSet[AuditLog] = weakref.WeakSet()
# Commit address -> the log object of this process serving it. Other log objects of this process on
# the same database commit their own appends instead of connecting to it: a log holds its lock while
# it waits for the committer's reply, and the at-fork hook takes every log's lock before a fork, so
# a forking thread that held the serving log's lock (which the committer needs) while waiting for
# the waiting log's one would deadlock until the client's timeout (found with the loader benchmark:
# a durable and an asynchronous log on one database, then a DataLoader forking its workers).
_SERVING_HERE: weakref.WeakValueDictionary[str, AuditLog] = weakref.WeakValueDictionary()
#: Connection pools inherited from the parent; kept referenced forever so they are never closed here.
_INHERITED: list[Any] = []


_EXIT_HOOKS_PID: int | None = None


def _flush_all_async() -> None:
    for audit_log in list(_LIVE_LOGS):
        if audit_log._server is not None and audit_log._pid == os.getpid():
            try:  # other processes get "bye" and commit themselves; short wait: a signal may be in an append
                audit_log._stop_serving(timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
                log.error("audit committer could not stop cleanly: %s", type(exc).__name__)
    for audit_log in list(_LIVE_LOGS):
        if not audit_log.durable and not audit_log._closed and audit_log._pid == os.getpid():
            try:
                audit_log.flush()
            except Exception as exc:  # noqa: BLE001 - at exit there is no caller left to raise to
                log.error("audit entries could not be flushed at exit: %s", exc)


def _install_exit_flush() -> None:
    """Flush asynchronous logs at interpreter exit, at multiprocessing-worker exit and on SIGTERM."""
    global _EXIT_HOOKS_PID
    if _EXIT_HOOKS_PID == os.getpid():
        return
    _EXIT_HOOKS_PID = os.getpid()
    atexit.register(_flush_all_async)
    from multiprocessing import util as mp_util

    # Worker processes leave through os._exit() after running these finalizers (atexit is skipped).
    mp_util.Finalize(None, _flush_all_async, exitpriority=100)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def _on_sigterm(signum: int, frame: Any) -> None:
        _flush_all_async()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main interpreter
        pass


def _after_fork_in_child() -> None:
    _SERVING_HERE.clear()  # a forked child serves nothing (its copies of the servers are closed)
    _reset_turn_queues()
    for audit_log in list(_LIVE_LOGS):
        audit_log._forget_inherited_state()


_HELD_AT_FORK: list[Any] = []
#: Forks of this process waiting in _before_fork for the logs' locks, and the gate where writers
#: wait meanwhile before they start another transaction (see _fork_gate).
_FORKS_WAITING = 0
_FORK_GATE = threading.Condition(threading.Lock())


def _fork_gate() -> None:
    """Wait while a fork of this process waits for the logs' locks; call holding no log's lock.

    Threading locks are not fair: a thread appending in a loop (an asynchronous log's flusher)
    released its log's lock and took it again before the forking thread, waiting for it, woke up,
    so a fork could wait for many transactions. Held here, such a thread lets the fork through
    after the transaction it is in.
    """
    if _FORKS_WAITING:  # unlocked read: a fork that has just begun waits one transaction at most
        with _FORK_GATE:
            while _FORKS_WAITING:
                _FORK_GATE.wait(0.5)


def _before_fork() -> None:
    # No append/checkpoint transaction of this process may be in flight when it forks: SQLite keeps
    # per-file lock state in process memory, and a child inheriting "lock held" would wait forever.
    global _FORKS_WAITING
    with _FORK_GATE:
        _FORKS_WAITING += 1
    for audit_log in list(_LIVE_LOGS):
        lock = audit_log._lock
        lock.acquire()
        _HELD_AT_FORK.append(lock)


def _after_fork_in_parent() -> None:
    global _FORKS_WAITING
    while _HELD_AT_FORK:
        _HELD_AT_FORK.pop().release()
    with _FORK_GATE:
        _FORKS_WAITING -= 1
        _FORK_GATE.notify_all()


def _after_fork_in_child_all() -> None:
    global _FORKS_WAITING, _FORK_GATE
    _HELD_AT_FORK.clear()  # the child replaces every log's lock (see _forget_inherited_state)
    _FORKS_WAITING, _FORK_GATE = 0, threading.Condition(threading.Lock())
    _after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                         after_in_child=_after_fork_in_child_all)


def open_audit_log(url_or_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> AuditLog:
    """Open the default (or given) audit log: ``$SECURETRAIN_AUDIT_URL`` or ``<data dir>/audit.db``."""
    return AuditLog(url_or_path, **kwargs)

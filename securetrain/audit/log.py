"""The database-backed, hash-chained, append-only audit log.

``AuditLog`` implements :class:`~securetrain.audit.recorder.AuditRecorder`. Each append runs in one
transaction that first takes the log's write lock — SQLite ``BEGIN IMMEDIATE``, PostgreSQL
``pg_advisory_xact_lock`` — then reads the head and assigns ``seq``/``prev_hash`` under the lock, so
concurrent writers (threads or processes) can never fork the chain. Signed checkpoints are written
every ``checkpoint_every`` entries and on demand, and are published to the configured anchors.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import Connection, Engine, create_engine, event, inspect, insert, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import IntegrityError as SAIntegrityError

from securetrain.audit import canonical as canon
from securetrain.audit.anchors import Anchor
from securetrain.audit.errors import AuditConfigError, AuditError, AuditEventError, AuditIntegrityError
from securetrain.audit.keys import load_or_create_signing_key, public_key_pem
from securetrain.audit.merkle import CompactRange, consistency_proof, inclusion_proof, leaf_hash, root_hash
from securetrain.audit.models import TABLES, AuditCheckpointRow, AuditEntryRow
from securetrain.audit.note import (
    Checkpoint,
    find_signer,
    parse_checkpoint_text,
    parse_note,
    sign_checkpoint,
    verifier_key,
    verify_note,
)
from securetrain.audit.triggers import postgres_ddl, sqlite_ddl
from securetrain.audit.verify import Record, VerifyReport, verify_records

log = logging.getLogger(__name__)

E = AuditEntryRow.__table__  # type: ignore[attr-defined]
C = AuditCheckpointRow.__table__  # type: ignore[attr-defined]

DEFAULT_PG_SCHEMA = "securetrain_audit"
_BATCH = 2000


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

    def hashed_object(self) -> dict[str, Any]:
        return canon.entry_object(
            seq=self.seq, ts=self.ts, actor=self.actor, hostname=self.hostname, mac=self.mac, action=self.action,
            resource=self.resource, outcome=self.outcome, details=self.details, prev_hash=self.prev_hash,
        )

    def hashed_bytes(self) -> bytes:
        return canon.canonical_bytes(self.hashed_object())


def _entry_from_row(row: Any) -> tuple[AuditEntry, str]:
    """Entry plus the raw stored details text (verification checks it is canonical)."""
    try:
        details = json.loads(row.details)
    except (TypeError, json.JSONDecodeError):
        details = {"__unparseable__": str(row.details)[:64]}
    return (
        AuditEntry(row.seq, row.ts, row.actor, row.hostname, row.mac, row.action, row.resource, row.outcome,
                   details if isinstance(details, dict) else {"__not_an_object__": True}, row.prev_hash, row.entry_hash),
        row.details,
    )


class AuditLog:
    """Append-only audit log on SQLite (default) or PostgreSQL. Safe to share across threads."""

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        actor: str | None = None,
        signing_key: Ed25519PrivateKey | str | os.PathLike[str] | None = None,
        origin: str | None = None,
        checkpoint_every: int | None = 1000,
        anchors: Sequence[Anchor] = (),
        schema: str | None = None,
        create: bool = True,
        busy_timeout_s: float = 30.0,
    ) -> None:
        self.url = _normalise_url(url)
        # Kept so a worker process can reopen the same log (see __getstate__).
        self._reopen_args = {"actor": actor, "signing_key": signing_key, "origin": origin,
                             "checkpoint_every": checkpoint_every, "anchors": tuple(anchors), "schema": schema,
                             "busy_timeout_s": busy_timeout_s}
        self.actor = canon._check_text("actor", actor or os.environ.get("SECURETRAIN_ACTOR") or getpass.getuser(), limit=256)
        self.hostname = socket.gethostname() or "unknown"
        self.mac = canon.mac_address()
        self.checkpoint_every = checkpoint_every
        self.anchors = list(anchors)
        self._signing_key_src = signing_key
        self._signing_key: Ed25519PrivateKey | None = signing_key if isinstance(signing_key, Ed25519PrivateKey) else None
        self._origin = origin
        self._lock = threading.RLock()
        self._cache = CompactRange()
        self._cache_head = canon.GENESIS_HASH  # entry_hash of the last leaf in _cache
        self.backend = self.url.split(":", 1)[0].split("+", 1)[0]
        if self.backend == "sqlite":
            self.schema = None
            db_file = Path(self.url.split(":///", 1)[1]) if ":///" in self.url else None
            if db_file is not None and str(db_file) != ":memory:":
                if create:
                    db_file.parent.mkdir(parents=True, exist_ok=True)
                elif not db_file.is_file():
                    # Opening would silently create an empty log that then "verifies": fail closed.
                    raise AuditConfigError(f"no audit database at {db_file}", hint="check --db / SECURETRAIN_AUDIT_URL")
            self._write_engine = self._sqlite_engine(immediate=True, timeout=busy_timeout_s)
            self._read_engine = self._sqlite_engine(immediate=False, timeout=busy_timeout_s)
        elif self.backend in ("postgresql", "postgres"):
            self.schema = schema or DEFAULT_PG_SCHEMA
            if not self.schema.replace("_", "").isalnum():
                raise AuditConfigError(f"PostgreSQL schema name {self.schema!r} must be alphanumeric/underscore")
            base = create_engine(self.url, pool_pre_ping=True, pool_size=3, max_overflow=2)
            self._write_engine = self._read_engine = base.execution_options(schema_translate_map={None: self.schema})
            self._base_engine = base
            digest = hashlib.sha256(f"securetrain.audit:{self.schema}".encode()).digest()
            self._lock_key = int.from_bytes(digest[:8], "big", signed=True)
        else:
            raise AuditConfigError(f"unsupported audit database URL scheme {self.backend!r}", hint="use a path, sqlite:/// or postgresql+psycopg://")
        if create:
            self._ensure_schema()
        else:
            self._require_schema()

    # -- engines and schema ---------------------------------------------------------------
    def _sqlite_engine(self, *, immediate: bool, timeout: float) -> Engine:
        engine = create_engine(self.url, connect_args={"timeout": timeout, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA recursive_triggers=ON")
            cur.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    def _take_lock(self, conn: Connection) -> None:
        if self.backend != "sqlite":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": self._lock_key})

    def _require_schema(self) -> None:
        try:
            with self._read_engine.connect() as conn:
                present = inspect(conn).has_table(E.name, schema=self.schema)
        except DBAPIError as exc:  # unreachable server, and also a file that is not a database
            raise AuditError(f"cannot open audit database ({self.backend}): {exc.orig}", hint="check the URL and that the server is up") from None
        if not present:
            raise AuditConfigError("the database holds no securetrain audit log", hint="check --db / SECURETRAIN_AUDIT_URL")

    def _ensure_schema(self) -> None:
        try:
            with self._write_engine.begin() as conn:
                self._take_lock(conn)
                if inspect(conn).has_table(E.name, schema=self.schema):
                    return
                if self.schema:
                    conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                for table in TABLES:
                    table.create(conn, checkfirst=True)
                if self.backend == "sqlite":
                    stmts = sqlite_ddl()
                else:  # psycopg treats % as a placeholder even without parameters
                    stmts = [s.replace("%", "%%") for s in postgres_ddl(self.schema or "")]
                for stmt in stmts:
                    conn.exec_driver_sql(stmt)
        except DBAPIError as exc:  # unreachable server, and also a file that is not a database
            raise AuditError(f"cannot open audit database ({self.backend}): {exc.orig}", hint="check the URL and that the server is up") from None

    # -- key and identity -----------------------------------------------------------------
    @property
    def signing_key(self) -> Ed25519PrivateKey:
        if self._signing_key is None:
            path = self._signing_key_src or os.environ.get("SECURETRAIN_AUDIT_KEY") or data_dir() / "audit_signing_key.pem"
            self._signing_key = load_or_create_signing_key(path)  # type: ignore[arg-type]
        return self._signing_key

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.signing_key.public_key()

    @property
    def origin(self) -> str:
        """Checkpoint origin and note key name; by default tied to the public key."""
        if self._origin is None:
            raw = public_key_pem(self.public_key)
            self._origin = f"securetrain.local/audit/{hashlib.sha256(raw).hexdigest()[:16]}"
        return self._origin

    def verifier_key(self) -> str:
        return verifier_key(self.origin, self.public_key)

    def public_key_pem(self) -> bytes:
        return public_key_pem(self.public_key)

    # -- writing --------------------------------------------------------------------------
    def record(
        self, action: str, resource: str, *, outcome: str = "success", details: Mapping[str, Any] | None = None
    ) -> AuditEntry:
        """Append one event (the ``AuditRecorder`` protocol)."""
        return self.append_many([(action, resource, outcome, details)])[0]

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
            canon.validate_event(action, resource, outcome)
            clean = canon.validate_details(details)
            prepared.append((action, resource, outcome, clean, canon.canonical_bytes(clean).decode()))
        if not prepared:
            return []
        entries: list[AuditEntry] = []
        with self._lock:
            try:
                with self._write_engine.begin() as conn:
                    self._take_lock(conn)
                    head = conn.execute(select(E.c.seq, E.c.entry_hash).order_by(E.c.seq.desc()).limit(1)).first()
                    seq, prev = (head.seq + 1, head.entry_hash) if head else (0, canon.GENESIS_HASH)
                    start = seq
                    rows = []
                    for action, resource, outcome, clean, details_json in prepared:
                        entry = AuditEntry(seq, canon.utc_timestamp(), self.actor, self.hostname, self.mac, action,
                                           resource, outcome, clean, prev, "")
                        digest = canon.sha256_hex(entry.hashed_bytes())
                        entry = AuditEntry(**{**entry.__dict__, "entry_hash": digest})
                        entries.append(entry)
                        rows.append({**entry.__dict__, "details": details_json})
                        seq, prev = seq + 1, digest
                    conn.execute(insert(E), rows)
            except (SAIntegrityError, DBAPIError) as exc:
                raise AuditError(f"audit append refused by the database: {type(exc.orig).__name__}",
                                 hint="the log may have been tampered with; run 'securetrain audit verify'") from None
        every = self.checkpoint_every
        if every and start // every != seq // every:
            self.checkpoint()
        return entries

    # -- reading --------------------------------------------------------------------------
    def size(self) -> int:
        with self._read_engine.connect() as conn:
            head = conn.execute(select(E.c.seq).order_by(E.c.seq.desc()).limit(1)).first()
        return 0 if head is None else head.seq + 1

    def _rows(self, conn: Connection, start: int, stop: int | None) -> Iterator[Any]:
        cursor = start
        while True:
            q = select(E).where(E.c.seq >= cursor).order_by(E.c.seq).limit(_BATCH)
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
            rows = conn.execute(select(E).order_by(E.c.seq.desc()).limit(n)).all()
        return [_entry_from_row(r)[0] for r in reversed(rows)]

    def checkpoints(self) -> list[Checkpoint]:
        with self._read_engine.connect() as conn:
            rows = conn.execute(select(C).order_by(C.c.tree_size)).all()
        out = []
        for r in rows:
            origin, size, root = parse_checkpoint_text(parse_note(r.note)[0])
            out.append(Checkpoint(origin, size, root, r.note))
        return out

    def latest_checkpoint(self) -> Checkpoint | None:
        cps = self.checkpoints()
        return cps[-1] if cps else None

    def _leaf_hashes(self, conn: Connection, stop: int) -> list[bytes]:
        return [leaf_hash(_entry_from_row(r)[0].hashed_bytes()) for r in self._rows(conn, 0, stop)]

    # -- checkpoints and proofs -----------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """Sign the current tree head (idempotent if nothing was appended) and publish it."""
        key, origin = self.signing_key, self.origin
        with self._lock:
            with self._write_engine.begin() as conn:
                self._take_lock(conn)
                head = conn.execute(select(E.c.seq).order_by(E.c.seq.desc()).limit(1)).first()
                size = 0 if head is None else head.seq + 1
                last = conn.execute(select(C).order_by(C.c.tree_size.desc()).limit(1)).first()
                if last is not None and last.tree_size == size:
                    o, s, r = parse_checkpoint_text(parse_note(last.note)[0])
                    return Checkpoint(o, s, r, last.note)
                self._extend_cache(conn, size, last)
                cp = sign_checkpoint(origin, size, self._cache.root(), origin, key)
                conn.execute(insert(C), [{"tree_size": size, "root_hash": cp.root_hash.hex(),
                                           "created_at": canon.utc_timestamp(), "note": cp.note}])
        for anchor in self.anchors:
            anchor.publish(cp)
        return cp

    def _extend_cache(self, conn: Connection, size: int, last: Any) -> None:
        """Grow the cached tree to ``size`` leaves, refusing to sign a history that was rewritten.

        The signing key must not become an oracle for someone who can only write the database:
        every new row must chain onto the cached head, and the tree must reproduce the newest
        stored checkpoint (whose signature is checked with our own key) at its size.
        """
        prev_size, prev_root = 0, None
        if last is not None:
            prev_size = last.tree_size
            text = verify_note(last.note, find_signer(last.note, self.public_key), self.public_key)
            prev_root = parse_checkpoint_text(text)[2]
            if prev_size > size:
                raise AuditIntegrityError(f"the log has {size} entries but checkpoint {prev_size} was signed: "
                                          "entries were deleted", seq=size, problem="truncated")
        if self._cache.size > prev_size:  # cannot be checked against the stored checkpoint: rebuild
            self._cache, self._cache_head = CompactRange(), canon.GENESIS_HASH
        for row in self._rows(conn, self._cache.size, size):
            if self._cache.size == prev_size and self._cache.root() != prev_root and prev_root is not None:
                break
            entry = _entry_from_row(row)[0]
            raw = entry.hashed_bytes()
            if row.seq != self._cache.size or entry.prev_hash != self._cache_head or canon.sha256_hex(raw) != entry.entry_hash:
                self._cache, self._cache_head = CompactRange(), canon.GENESIS_HASH
                raise AuditIntegrityError(f"entry seq={row.seq} does not chain onto the signed history; refusing to "
                                          "sign a checkpoint", seq=row.seq, problem="prev_hash",
                                          hint="the database was modified; run 'securetrain audit verify'")
            self._cache.append(leaf_hash(raw))
            self._cache_head = entry.entry_hash
        if prev_root is not None and (self._cache.size < prev_size or
                                      (self._cache.size == prev_size and self._cache.root() != prev_root)):
            self._cache, self._cache_head = CompactRange(), canon.GENESIS_HASH
            raise AuditIntegrityError(f"the first {prev_size} entries no longer match the signed checkpoint; "
                                      "refusing to sign a rewritten history", seq=prev_size - 1 if prev_size else None,
                                      problem="checkpoint-root", hint="run 'securetrain audit verify'")

    def inclusion_proof(self, seq: int, tree_size: int | None = None) -> dict[str, Any]:
        """RFC 6962 inclusion proof of entry ``seq`` in the tree of ``tree_size`` (default: latest checkpoint)."""
        if tree_size is None:
            cp = self.latest_checkpoint()
            tree_size = cp.tree_size if cp else self.size()
        with self._read_engine.connect() as conn:
            leaves = self._leaf_hashes(conn, tree_size)
            row = conn.execute(select(E).where(E.c.seq == seq)).first()
        if len(leaves) != tree_size or row is None or not 0 <= seq < tree_size:
            raise AuditError(f"entry {seq} is not in a tree of size {tree_size} (log has {len(leaves)} entries)")
        entry = _entry_from_row(row)[0]
        return {
            "seq": seq, "tree_size": tree_size, "leaf_index": seq,
            "entry": entry.hashed_bytes().decode(), "leaf_hash": leaves[seq].hex(),
            "root_hash": root_hash(leaves).hex(), "proof": [p.hex() for p in inclusion_proof(seq, leaves)],
        }

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> dict[str, Any]:
        new_size = self.size() if new_size is None else new_size
        with self._read_engine.connect() as conn:
            leaves = self._leaf_hashes(conn, new_size)
        if len(leaves) != new_size or not 0 <= old_size <= new_size:
            raise AuditError(f"cannot prove {old_size} -> {new_size}: log has {len(leaves)} entries")
        return {
            "old_size": old_size, "new_size": new_size, "old_root": root_hash(leaves[:old_size]).hex(),
            "new_root": root_hash(leaves).hex(), "proof": [p.hex() for p in consistency_proof(old_size, leaves)],
        }

    # -- verification and export ----------------------------------------------------------
    def _records(self) -> Iterator[Record]:
        with self._read_engine.connect() as conn:
            for row in self._rows(conn, 0, None):
                entry, details_text = _entry_from_row(row)
                obj = entry.hashed_object()
                try:
                    raw = entry.hashed_bytes()
                    if canon.canonical_bytes(entry.details).decode() != details_text:
                        obj = {**obj, "details": {"__stored_details_not_canonical__": True}}
                except AuditEventError:  # a tampered row with no canonical form: let the verifier name it
                    raw, obj = b"", {**obj, "details": {"__stored_details_not_canonical__": True}}
                yield Record(raw, obj, stored_hash=row.entry_hash, stored_seq=row.seq)

    def verify(
        self, *, trusted_checkpoints: Sequence[str] = (), public_key: Ed25519PublicKey | None = None,
        on_entry: Any = None,
    ) -> VerifyReport:
        """Recompute every hash, the Merkle root at each checkpoint and all signatures.

        ``public_key`` defaults to this log's own key; pass an independently held one to detect a
        database re-signed with a different key. ``trusted_checkpoints`` are notes kept elsewhere.
        """
        key = public_key or self.public_key
        notes = [c.note for c in self.checkpoints()]
        return verify_records(self._records(), public_key=key, checkpoint_notes=notes,
                              trusted_notes=trusted_checkpoints, on_entry=on_entry)

    def export(self, outdir: str | os.PathLike[str], *, checkpoint: bool = True) -> Path:
        from securetrain.audit.export import export_log

        return export_log(self, outdir, checkpoint=checkpoint)

    # -- pickling: DataLoader workers and process pools reopen the log by URL -------------
    def __getstate__(self) -> dict[str, Any]:
        if isinstance(self._reopen_args["signing_key"], Ed25519PrivateKey):
            raise AuditConfigError(
                "an AuditLog holding an in-memory signing key cannot be sent to another process",
                hint="open the log with signing_key=<path to the PEM file> instead",
            )
        # Database handles and locks never cross processes; the child opens its own engines, and
        # the database lock (BEGIN IMMEDIATE / advisory lock) keeps the chain linear across them.
        return {"url": self.url, "args": self._reopen_args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], create=False, **state["args"])  # type: ignore[misc]

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        self._write_engine.dispose()
        if self._read_engine is not self._write_engine:
            self._read_engine.dispose()
        base = getattr(self, "_base_engine", None)
        if base is not None:
            base.dispose()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_audit_log(url_or_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> AuditLog:
    """Open the default (or given) audit log: ``$SECURETRAIN_AUDIT_URL`` or ``<data dir>/audit.db``."""
    return AuditLog(url_or_path, **kwargs)

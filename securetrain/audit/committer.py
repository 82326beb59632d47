"""Cross-process group commit: one process on a host commits the durable appends of the others.

A durable append holds the log's chain lock through its commit, so writer processes that each
commit their own entries are bounded by one commit at a time (about 1,000 appends/s from 8
processes, whatever the database). Here the process that opened a log first serves a Unix socket
(Linux abstract namespace, named after the log and the user) from a thread; the log's other
processes on the host send their events there and get back the stored entries once the
transaction holding them has committed. The server feeds every request into its own in-process
group commit (``AuditLog._submit``), so the appends of N processes share one transaction: the same
entries, the same chain and the same durability as committing them oneself.

Safety rules, each enforced here:

* Only a peer running as the same user is served, and a client only talks to a server running as
  its own user (``SO_PEERCRED`` on both sides; abstract sockets have no file permissions).
* A client verifies every returned entry by recomputing its hash from its own event: the server
  cannot substitute entries.
* A server that shuts down (``close()``, interpreter or worker exit) finishes the request it is
  committing and answers every later one with ``bye``: not processed, commit it elsewhere. Only a
  server killed while committing leaves a client unsure whether its entries landed; the client
  then raises (as after a lost database connection during COMMIT) instead of retrying, so nothing
  is ever recorded twice.
* Anything unexpected on the client side (no server, a refused peer, a malformed reply before the
  request was sent) falls back to committing directly: the shared committer is an optimisation,
  never a dependency.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from securetrain.audit import errors as audit_errors
from securetrain.audit.errors import AuditError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
#: Largest frame accepted (a batch of many entries with large details still fits).
MAX_FRAME = 64 * 1024 * 1024
_UCRED = struct.Struct("3i")
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode
BYE = {"bye": True}
#: Longest wait for more writers before a transaction starts (see CommitServer._linger).
MAX_LINGER_S = 0.002
#: About how far apart writers' requests arrive after a batch's replies (measured: 30-60 us).
_ARRIVAL_GAP_S = 0.00004
HELLO = {"hello": 1}


def supported() -> bool:
    """Abstract Unix sockets and ``SO_PEERCRED``: Linux only (elsewhere every process commits itself)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


def address_for(identity: str) -> str:
    """The abstract socket name of a log: its identity (database file or URL without password and
    schema) and the user id, hashed so that no path or host name appears in ``/proc/net/unix``."""
    digest = hashlib.sha256(f"{os.getuid()}\0{identity}".encode()).hexdigest()[:40]
    return f"\0securetrain-audit-{digest}"


def _peer_uid(sock: socket.socket) -> int:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def _send(sock: socket.socket, obj: Any) -> None:
    body = _ENCODE(obj).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


class _Incomplete:
    """No complete frame buffered yet."""


INCOMPLETE = _Incomplete()


class FrameReader:
    """The frames of one stream, read with as few ``recv`` calls as possible.

    A frame usually arrives in one read, and two can share one (a reply and the ``bye`` that
    follows it at shutdown): bytes past the first frame stay buffered for the next. Reading the
    header and the body with a call each cost a system call per frame on both sides of every
    append.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def pop(self) -> Any:
        """The next buffered frame, decoded, or :data:`INCOMPLETE`. Raises ValueError for a
        malformed frame (too large, not JSON)."""
        buf = self._buf
        if len(buf) < _HEADER.size:
            return INCOMPLETE
        (length,) = _HEADER.unpack_from(buf)
        if length > MAX_FRAME:
            raise ValueError("frame too large")
        end = _HEADER.size + length
        if len(buf) < end:
            return INCOMPLETE
        body = buf[_HEADER.size:end]
        del buf[:end]
        return json.loads(body)

    def fill(self, sock: socket.socket) -> bool:
        """One ``recv`` into the buffer (it blocks only when nothing has arrived); False at end of
        stream."""
        data = sock.recv(1 << 16)
        if not data:
            return False
        self._buf += data
        return True

    def read(self, sock: socket.socket) -> Any:
        """The next frame (waiting for it), or None at end of stream. Raises ValueError for a
        malformed frame."""
        while True:
            frame = self.pop()
            if frame is not INCOMPLETE:
                return frame
            if not self.fill(sock):
                return None


class CommitServer:
    """Serves a log's durable appends to its other processes from one thread.

    The thread waits on every connection at once (``selectors``), reads each request that has
    arrived, and hands them all to ``handle_many(requests) -> replies`` in one call, which commits
    them as one group: one wake-up per batch rather than a thread hand-off per request (measured:
    context switches, not Python, dominated the cost per append). This class owns the socket, the
    peer checks and an orderly shutdown.
    """

    def __init__(self, address: str, handle_many: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], *,
                 linger: bool = True) -> None:
        self._lingers = linger  # see _linger: worth it where a transaction's own cost is high
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(address)  # OSError (EADDRINUSE) when another process already serves this log
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        # A log's method is held weakly: the serving thread must not keep a log its owner dropped
        # (with its connections) alive; once it is gone the server stops at its next wake-up.
        self._handle_ref: Callable[[], Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None] = (
            weakref.WeakMethod(handle_many) if inspect.ismethod(handle_many) else (lambda: handle_many))
        self._closing = False
        self._conns: dict[socket.socket, FrameReader] = {}
        self._pid = os.getpid()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="securetrain-audit-committer", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            # Reads happen only when the selector reports data (a partial frame stays buffered, so a
            # peer that stalls mid-frame holds up nothing); a reply that cannot be sent in 5 s drops
            # the peer.
            conn.settimeout(5.0)
            if _peer_uid(conn) != os.getuid():
                log.warning("audit committer: refused a connection from another user")
                conn.close()
                return
            # Registered, then greeted: a client sends nothing before this greeting, so a connection
            # dropped before it carried no request; from here on shutdown answers bye on it.
            _send(conn, HELLO)
        except OSError:
            conn.close()
            return
        self._conns[conn] = FrameReader()
        self._selector.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        self._conns.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def _read_ready(self, batch: list[tuple[socket.socket, dict[str, Any]]], timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds, None: until something happens), then accept, read and
        queue into ``batch`` what is ready; True if kicked."""
        kicked = False
        for key, _mask in self._selector.select(timeout):
            obj = key.fileobj
            if obj is self._sock:
                self._accept()
            elif obj == self._wake_r:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 512)
                kicked = True
            else:
                assert isinstance(obj, socket.socket)
                reader = self._conns.get(obj)
                requests: list[dict[str, Any]] = []
                try:
                    alive = reader is not None and reader.fill(obj)
                    while alive:
                        request = reader.pop()  # type: ignore[union-attr]
                        if request is INCOMPLETE:
                            break
                        if not isinstance(request, dict):
                            raise ValueError("a request must be an object")
                        requests.append(request)
                except (OSError, ValueError):
                    alive = False
                if alive:
                    batch.extend((obj, request) for request in requests)
                else:  # end of stream or a malformed frame: the peer is gone, its requests unanswered
                    self._drop(obj)
        return kicked

    def _loop(self) -> None:
        try:
            expected: set[Any] = set()  # who took part in the last transaction
            commit_s = 0.0  # how long it took
            while not self._closing:
                batch: list[tuple[socket.socket, dict[str, Any]]] = []
                kicked = self._read_ready(batch)
                if batch or kicked:
                    kicked = self._linger(batch, kicked, expected, commit_s)
                if self._closing or not (batch or kicked):
                    continue  # read but not processed when closing: answered bye below
                handle_many = self._handle_ref()
                if handle_many is None:  # the log was garbage-collected without close()
                    self._closing = True
                    continue
                expected = self._senders(batch, kicked)
                started = time.monotonic()
                try:
                    replies = handle_many([request for _, request in batch])
                except Exception as exc:  # noqa: BLE001 - every request of the batch gets the error
                    replies = [error_reply(exc)] * len(batch)
                commit_s = time.monotonic() - started
                for (conn, _), reply in zip(batch, replies, strict=True):
                    try:
                        _send(conn, reply)
                    except OSError:
                        self._drop(conn)
        finally:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    _send(conn, BYE)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._close_descriptors()

    def _senders(self, batch: list[tuple[socket.socket, dict[str, Any]]], kicked: bool) -> set[Any]:
        """The connections (and this process, as ``self``, when it kicked) with requests in ``batch``."""
        senders: set[Any] = {conn for conn, _ in batch}
        if kicked:
            senders.add(self)
        return senders

    def _linger(self, batch: list[tuple[socket.socket, dict[str, Any]]], kicked: bool, expected: set[Any],
                commit_s: float) -> bool:
        """Wait briefly for the rest of the last transaction's writers to send again; True if kicked.

        Writers that each wait for their own entry come back at slightly different times after their
        replies; committing the first arrival at once split 8 of them into transactions of 4-5 on
        average, each paying the database's per-transaction cost (measured). The wait ends as soon
        as every writer of the last transaction is in, and never lasts longer than that transaction
        took: a writer that is late anyway would only have waited that long for the next commit.
        A writer that does not come back drops out of ``expected`` with this batch.
        """
        if not self._lingers:
            return kicked
        expected = {who for who in expected if who is self or who in self._conns}  # a dropped peer never sends
        wait = min(commit_s, MAX_LINGER_S)
        if wait <= 0.0 or len(expected) < 2:
            return kicked
        deadline = time.monotonic() + wait
        while not self._closing:
            missing = len(expected - self._senders(batch, kicked))
            left = deadline - time.monotonic()
            if not missing or left <= 0.0:
                break
            if missing > 1:  # let several arrive per wake-up (each costs the clients' CPU a switch)
                time.sleep(min(left, _ARRIVAL_GAP_S * missing))
                left = max(0.0, deadline - time.monotonic())
            kicked = self._read_ready(batch, left) or kicked
        return kicked

    def _close_descriptors(self) -> None:
        """Close this process's descriptors: the listening socket, the connections, the selector and
        its wake-up pipe (plain close: ends nothing another process holds)."""
        for sock in (self._sock, *self._conns):
            with contextlib.suppress(OSError):
                sock.close()
        self._conns.clear()
        with contextlib.suppress(Exception):
            self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def kick(self) -> None:
        """Wake the serving thread: ``handle_many`` runs (with the requests that have arrived, if any)
        even when no other process sent one. The serving process's own appends queue up and kick,
        so they share the transaction of the other processes' appends."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"k")

    def serves(self) -> bool:
        """True while the serving thread runs (it may commit appends queued by this process)."""
        return not self._closing and self._thread.is_alive() and self._pid == os.getpid()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the descriptors, never shutting anything
        down (the parent keeps serving). Kept open, the child's copy of the listening socket would
        hold the log's address after the parent stops, and the next server could not bind it."""
        self._closing = True
        self._close_descriptors()

    def close(self, timeout: float = 60.0) -> None:
        """Stop serving: the batch being committed completes and is answered; the rest gets ``bye``."""
        if self._pid != os.getpid() or self._closing:  # a forked child's copy: the sockets are the parent's
            return
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def error_reply(exc: BaseException) -> dict[str, Any]:
    hint = getattr(exc, "hint", None)
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    return {"error": {"kind": type(exc).__name__, "message": message, "hint": hint}}


def error_from_reply(err: Any) -> AuditError:
    """Rebuild the server's error as the same audit exception class (plain AuditError otherwise)."""
    if not isinstance(err, dict):
        return AuditError("the audit committer sent a malformed error")
    kind, message, hint = err.get("kind"), str(err.get("message", "")), err.get("hint")
    cls = getattr(audit_errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, AuditError)):
        cls = AuditError
    try:
        return cls(message, hint=hint if isinstance(hint, str) else None)
    except TypeError:  # a subclass with another constructor
        return AuditError(message, hint=hint if isinstance(hint, str) else None)


class Unprocessed(Exception):
    """The server did not process the request (absent, shutting down, wrong user): commit it yourself."""


class CommitClient:
    """One process's connection to its log's committer. Not thread-safe: use under the log's lock."""

    def __init__(self, address: str, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._reader = FrameReader()
        try:
            sock.settimeout(min(timeout, 2.0))  # connecting and the greeting: a stuck server is skipped
            sock.connect(address)
            if _peer_uid(sock) != os.getuid():
                raise Unprocessed("the audit committer runs as another user")
            try:
                greeting = self._reader.read(sock)
            except (OSError, ValueError) as exc:
                raise Unprocessed(type(exc).__name__) from exc
            if greeting != HELLO:  # bye, end of stream or a stranger: nothing was sent yet
                raise Unprocessed("no greeting from the audit committer")
            sock.settimeout(timeout)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send ``request`` and return the reply.

        Raises :class:`Unprocessed` when the server certainly did not process it, and
        :class:`AuditError` when it may have (the connection ended after the request was sent).
        """
        try:
            _send(self._sock, request)
        except OSError as exc:
            # A server that is gone never read a complete frame: nothing was processed.
            raise Unprocessed(type(exc).__name__) from exc
        try:
            reply = self._reader.read(self._sock)
        except (OSError, ValueError) as exc:
            reply = exc
        if isinstance(reply, dict) and reply.get("bye"):
            raise Unprocessed("committer shutting down")
        if not isinstance(reply, dict):
            what = type(reply).__name__ if isinstance(reply, BaseException) else "end of stream"
            raise AuditError(
                f"the process committing this log's appends ended while committing ({what}); "
                "whether these entries were recorded is unknown",
                hint="the log stays consistent either way; `securetrain audit show` lists the last entries")
        return reply

    def close(self) -> None:
        """Close the connection (in a forked child: only the child's copy of the descriptor)."""
        with contextlib.suppress(OSError):
            self._sock.close()

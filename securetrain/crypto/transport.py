"""Encrypted, authenticated tensor messages between processes and hosts.

Recipient model (see ``docs/tensor-transport.md``): every party has a static X25519 key pair and
knows its peers' public keys (distributed out of band, like SSH host keys). A sender opens a
*session* with a fresh random 16-byte session id; the session key is
``HKDF-SHA256(X25519(sender, recipient), salt=session_id, info=label|ids|public keys)``, so a
restarted sender never reuses a (key, nonce) pair. Each message carries a strictly increasing
64-bit counter and a timestamp; the receiver remembers the last counter per (sender, session) and
rejects replays, reordering, expired messages and messages addressed to someone else - after
authentication, before deserializing anything.

Message layout, version 2 (written; big-endian)::

    header  "STTM" | u8 2 | u8 len | sender_id | u8 len | recipient_id | 16 session_id
            | u64 counter | u64 timestamp_ms | u32 segment_size | u64 payload_length | u32 head_length
    tag     16 bytes: AES-256-GCM(key, nonce(counter, 0), plaintext="", aad=header)
    segments  the safetensors payload cut into regions - the safetensors header (head_length bytes),
            then each tensor's bytes - and each region into segments of <= segment_size bytes;
            segment i (from 1): AES-256-GCM(key, nonce(counter, i), chunk, aad=SHA-256(header)) || tag

``nonce(c, i) = u64 c || u32 i``. The header is authenticated on its own, *before* the receiver
allocates anything for the payload; sizes above the configured :class:`TransportLimits` are
refused; each tensor is allocated only when its first segment arrives and decrypted straight into
its memory. Segments come from the tensors' own memory on the sender (no serialized copy).
Version 1 (one GCM call over the whole payload, nonce ``0000 || u64 counter``) is still opened.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from securetrain.crypto._container import (
    GCM_MAX_PLAINTEXT_BYTES,
    build_header,
    byte_view,
    cpu_contiguous,
    decode_tensors,
    encode_tensors,
    parse_header,
    prepare_tensors,
    refuse,
    restore_aliases,
    split_header,
)
from securetrain.crypto.errors import (
    HeaderFormatError,
    KeyNotFoundError,
    LimitExceededError,
    MessageAuthError,
    ReplayError,
    TrailingDataError,
    TruncatedError,
    UnsafePayloadError,
)
from securetrain.crypto.keys import validate_key_id

MAGIC = b"STTM"
VERSION = 2  # written; 1 and 2 are opened
TAG_BYTES = 16
SESSION_ID_BYTES = 16
MAX_COUNTER = 2**64 - 1
MAX_SEGMENTS = 2**32 - 1
MIN_SEGMENT_BYTES = 16
DEFAULT_SEGMENT_BYTES = 1 << 20
_LABELS = {1: b"securetrain-transport-v1", 2: b"securetrain-transport-v2"}
_V2_TAIL = struct.Struct(">QQIQI")  # counter, timestamp_ms, segment_size, payload_length, head_length
_NONCE2 = struct.Struct(">QI")
ENV_MAX_MESSAGE = "SECURETRAIN_TRANSPORT_MAX_BYTES"


@dataclass(frozen=True)
class TransportLimits:
    """What a receiver accepts from an (authenticated) peer. Nothing is allocated for a message
    before its header authenticated; these caps bound what an authenticated peer can ask for."""

    max_message_bytes: int = 1 << 30  # whole payload (safetensors bytes)
    max_segment_bytes: int = 1 << 24  # the receive buffer is one segment
    max_header_bytes: int = 16 << 20  # the safetensors JSON header (names, shapes, metadata)

    @classmethod
    def from_env(cls) -> TransportLimits:
        """Defaults, with ``max_message_bytes`` from ``SECURETRAIN_TRANSPORT_MAX_BYTES`` if set."""
        raw = os.environ.get(ENV_MAX_MESSAGE)
        if not raw:
            return cls()
        try:
            value = int(raw)
        except ValueError:
            raise LimitExceededError(f"{ENV_MAX_MESSAGE} must be an integer number of bytes") from None
        if value < 1:
            raise LimitExceededError(f"{ENV_MAX_MESSAGE} must be positive")
        return cls(max_message_bytes=value)


DEFAULT_LIMITS = TransportLimits()
DEFAULT_MAX_FRAME = DEFAULT_LIMITS.max_message_bytes


class TransportIdentity:
    """A party's id and X25519 key pair. The private key is never shown or pickled."""

    __slots__ = ("_private", "party_id")

    def __init__(self, party_id: str, private_key: X25519PrivateKey) -> None:
        self.party_id = validate_key_id(party_id)
        self._private = private_key

    @classmethod
    def generate(cls, party_id: str) -> TransportIdentity:
        return cls(party_id, X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, party_id: str, raw: bytes) -> TransportIdentity:
        try:
            return cls(party_id, X25519PrivateKey.from_private_bytes(raw))
        except ValueError:
            raise MessageAuthError("an X25519 private key is 32 raw bytes") from None

    def private_bytes(self) -> bytes:
        """Raw 32-byte private key, for storing in a keyring; handle as a secret."""
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def public_bytes(self) -> bytes:
        return self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def _exchange(self, peer_public: bytes) -> bytes:
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
        except ValueError:
            # cryptography refuses an all-zero result itself (low-order point) and wrong lengths.
            raise MessageAuthError("peer public key is invalid or of low order (X25519 all-zero secret); refused",
                                   hint="check the peer's public key (32 raw bytes) in the configuration") from None
        if shared == bytes(32):
            raise MessageAuthError("X25519 produced the all-zero secret (low-order peer key); refused")
        return shared

    def __repr__(self) -> str:
        return f"TransportIdentity(party_id={self.party_id!r}, public={self.public_bytes().hex()[:16]}...)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("TransportIdentity cannot be pickled (it holds a private key)")


def _ids(sender: str, recipient: str) -> bytes:
    s, r = sender.encode(), recipient.encode()
    return struct.pack(">B", len(s)) + s + struct.pack(">B", len(r)) + r


def _session_key(shared: bytes, session_id: bytes, sender: str, recipient: str,
                 sender_pub: bytes, recipient_pub: bytes, version: int = VERSION) -> AESGCM:
    if shared == bytes(32):
        raise MessageAuthError("X25519 produced the all-zero secret (low-order peer key); refused")
    info = _LABELS[version] + _ids(sender, recipient) + sender_pub + recipient_pub
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=info).derive(shared))


def _nonce_v1(counter: int) -> bytes:
    return bytes(4) + struct.pack(">Q", counter)


class TensorSealer:
    """Seals tensor dicts from ``identity`` to one recipient; one instance = one session.

    ``seal()`` returns a message as bytes; ``send(sock, ...)`` streams it to a socket segment by
    segment, straight from the tensors' memory. ``version=1`` writes the legacy single-GCM layout.
    """

    def __init__(self, identity: TransportIdentity, recipient_id: str, recipient_public: bytes, *,
                 segment_size: int = DEFAULT_SEGMENT_BYTES, version: int = VERSION) -> None:
        if version not in _LABELS:
            raise HeaderFormatError(f"unknown transport version {version}")
        if not MIN_SEGMENT_BYTES <= segment_size <= DEFAULT_LIMITS.max_segment_bytes:
            raise LimitExceededError(f"segment_size must be in [{MIN_SEGMENT_BYTES}, "
                                     f"{DEFAULT_LIMITS.max_segment_bytes}]")
        self.identity = identity
        self.recipient_id = validate_key_id(recipient_id)
        self.version = version
        self.segment_size = segment_size
        self.session_id = secrets.token_bytes(SESSION_ID_BYTES)
        self._aead = _session_key(identity._exchange(recipient_public), self.session_id, identity.party_id,
                                  recipient_id, identity.public_bytes(), recipient_public, version)
        self._prefix = MAGIC + bytes([version]) + _ids(identity.party_id, recipient_id) + self.session_id
        self._counter = 0
        self._lock = threading.Lock()  # the counter is in the GCM nonce: it must never repeat, even across threads

    def _next_counter(self) -> int:
        with self._lock:
            if self._counter >= MAX_COUNTER:
                raise LimitExceededError("message counter exhausted; open a new session (new TensorSealer)")
            self._counter += 1
            return self._counter

    def seal(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
        if self.version == 1:
            payload = encode_tensors(tensors, metadata)
            if len(payload) > GCM_MAX_PLAINTEXT_BYTES:
                raise LimitExceededError("message exceeds the AES-GCM limit of 2^39-256 bits; split it")
            counter = self._next_counter()
            header = self._prefix + struct.pack(">QQ", counter, int(time.time() * 1000))
            return header + self._aead.encrypt(_nonce_v1(counter), payload, header)
        parts: list[bytes] = []
        self._write(lambda b: parts.append(bytes(b)), tensors, metadata)
        return b"".join(parts)

    def send(self, sock: socket.socket, tensors: Mapping[str, torch.Tensor],
             metadata: Mapping[str, str] | None = None) -> int:
        """Stream one v2 message to ``sock`` (self-delimiting: no outer frame); returns bytes sent."""
        if self.version != 2:
            raise HeaderFormatError("streaming needs transport version 2; use send_frame(sock, seal(...))")
        return self._write(sock.sendall, tensors, metadata)

    def _write(self, emit: Callable[[Any], object], tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str] | None) -> int:
        prepared = prepare_tensors(tensors)  # refuses what cannot be sent before a byte is
        hjson, data_len = build_header(prepared, metadata or {})
        head = struct.pack("<Q", len(hjson)) + hjson
        regions = [memoryview(head)] + [byte_view(cpu_contiguous(t)) for _, t in prepared.items]
        seg = self.segment_size
        nseg = sum(-(-len(r) // seg) for r in regions)
        if nseg > MAX_SEGMENTS:
            raise LimitExceededError(f"message needs {nseg} segments (max 2^32-1); raise segment_size or split it")
        counter = self._next_counter()
        header = self._prefix + _V2_TAIL.pack(counter, int(time.time() * 1000), seg, len(head) + data_len, len(head))
        aead = self._aead
        emit(header + aead.encrypt(_NONCE2.pack(counter, 0), b"", header))
        aad = hashlib.sha256(header).digest()
        out = memoryview(bytearray(seg + TAG_BYTES))
        index = 1
        for region in regions:
            for off in range(0, len(region), seg):
                chunk = region[off:off + seg]
                ct = out[:len(chunk) + TAG_BYTES]
                aead.encrypt_into(_NONCE2.pack(counter, index), chunk, aad, ct)
                emit(ct)
                index += 1
        return len(header) + TAG_BYTES + len(head) + data_len + (index - 1) * TAG_BYTES

    def __repr__(self) -> str:
        return f"TensorSealer({self.identity.party_id!r} -> {self.recipient_id!r}, sent={self._counter})"


# -- reading sources: a message in memory, or a socket ------------------------------------------


class _BytesSource:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def take(self, n: int, what: str = "message") -> memoryview:
        if self._pos + n > len(self._view):
            raise TruncatedError(f"tensor message is truncated (inside the {what})")
        out = self._view[self._pos:self._pos + n]
        self._pos += n
        return out

    def at_end(self) -> bool:
        return self._pos == len(self._view)


class _SocketSource:
    """Reads exactly-sized pieces from a socket into one reusable buffer (grown only on demand)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(256)

    def first(self, n: int) -> memoryview | None:
        """The first ``n`` bytes of a message, or ``None`` on a clean close before any byte."""
        view = memoryview(self._buf)[:n]
        got = self._sock.recv_into(view)
        if got == 0:
            return None
        self._fill(view, got, "message header")
        return view

    def reserve(self, n: int) -> None:
        if len(self._buf) < n:
            self._buf = bytearray(n)

    def take(self, n: int, what: str = "message") -> memoryview:
        self.reserve(n)
        view = memoryview(self._buf)[:n]
        self._fill(view, 0, what)
        return view

    def _fill(self, view: memoryview, got: int, what: str) -> None:
        while got < len(view):
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise TruncatedError(f"connection closed inside the {what} ({got} of {len(view)} bytes)")
            got += k


@dataclass(frozen=True)
class OpenedMessage:
    """An authenticated, decrypted message: its tensors and the sender's string metadata."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    metadata: dict[str, str]


class TensorOpener:
    """Opens messages addressed to ``identity`` from known ``peers`` ({party_id: public key}).

    ``open(bytes)`` for a message in memory (v1 or v2), ``recv(sock)`` to read one v2 message
    from a socket. ``limits`` (default :meth:`TransportLimits.from_env`) caps what is accepted.
    """

    def __init__(self, identity: TransportIdentity, peers: Mapping[str, bytes], *,
                 max_age_s: float | None = 600.0, max_sessions: int = 4096,
                 limits: TransportLimits | None = None) -> None:
        self.identity = identity
        self.peers = dict(peers)
        self.max_age_s = max_age_s
        self.limits = limits or TransportLimits.from_env()
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, bytes, int], tuple[AESGCM, int, int]] = OrderedDict()
        # Per sender, the newest timestamp of any session we forgot: a message of an unknown
        # session that is not newer could be a replay from an evicted one, so it is refused.
        self._evicted_floor_ms: dict[str, int] = {}
        self._lock = threading.Lock()

    def open(self, message: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
        return self.open_with_metadata(message).tensors

    def open_with_metadata(self, message: bytes | bytearray | memoryview) -> OpenedMessage:
        view = memoryview(message).cast("B")
        if len(view) > 4 and view[:4] == MAGIC and view[4] == 2:
            src = _BytesSource(view)
            return OpenedMessage(*self._open_v2(src, src.take(5, "header")))
        return OpenedMessage(*self._open_v1(bytes(view)))

    def recv(self, sock: socket.socket) -> OpenedMessage | None:
        """Read and open one v2 message from ``sock``; ``None`` on a clean close between messages."""
        src = _SocketSource(sock)
        first = src.first(5)
        if first is None:
            return None
        return OpenedMessage(*self._open_v2(src, bytes(first)))

    # -- version 2 ----------------------------------------------------------------------------
    def _open_v2(self, src: Any, first: bytes | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if bytes(first[:4]) != MAGIC:
            raise HeaderFormatError("not a securetrain tensor message (bad magic)")
        if first[4] != 2:
            raise HeaderFormatError(f"unsupported tensor message version {first[4]} here (expected 2)")
        parts = [bytes(first)]
        try:
            slen = src.take(1, "header")[0]
            sender = bytes(src.take(slen, "header")).decode()
            parts += [bytes([slen]), sender.encode()]
            rlen = src.take(1, "header")[0]
            recipient = bytes(src.take(rlen, "header")).decode()
            parts += [bytes([rlen]), recipient.encode()]
        except UnicodeDecodeError:
            raise HeaderFormatError("party id is not UTF-8") from None
        session_id = bytes(src.take(SESSION_ID_BYTES, "header"))
        tail = bytes(src.take(_V2_TAIL.size, "header"))
        header = b"".join(parts) + session_id + tail
        tag = bytes(src.take(TAG_BYTES, "header tag"))
        counter, ts_ms, seg, total, head_len = _V2_TAIL.unpack(tail)
        aead, key = self._session(sender, recipient, session_id, 2)
        try:  # the header alone is authenticated before anything is allocated for the payload
            aead.decrypt(_NONCE2.pack(counter, 0), tag, header)
        except InvalidTag:
            raise MessageAuthError(f"message header from {sender!r} failed authentication "
                                   "(modified, or not sealed by that sender for us)") from None
        self._admit(key, aead, sender, counter, ts_ms, commit=False)  # refuse replays before reading the body
        lim = self.limits
        if total > lim.max_message_bytes:
            raise LimitExceededError(f"message of {total} bytes from {sender!r} exceeds the "
                                     f"{lim.max_message_bytes}-byte limit", hint=f"raise {ENV_MAX_MESSAGE}")
        if not MIN_SEGMENT_BYTES <= seg <= lim.max_segment_bytes:
            raise LimitExceededError(f"segment size {seg} outside [{MIN_SEGMENT_BYTES}, {lim.max_segment_bytes}]")
        if not 10 <= head_len <= min(total, lim.max_header_bytes + 8):
            raise LimitExceededError(f"safetensors header of {head_len} bytes refused")
        if isinstance(src, _SocketSource):
            src.reserve(seg + TAG_BYTES)
        opener = _SegmentOpener(src, aead, counter, seg, hashlib.sha256(header).digest(), sender)
        head = opener.region_bytes(head_len)  # grows one authenticated segment at a time
        first8 = bytes(head[:8])
        hlen = split_header(first8, total)
        if 8 + hlen != head_len:
            raise UnsafePayloadError("header region length does not match the safetensors header")
        if head[8:9] != b"{":
            raise refuse(first8, "header is not a JSON object")
        entries, meta = parse_header(bytes(head[8:]), total - head_len)
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape, nbytes in entries:
            t = torch.empty(shape, dtype=dtype)  # allocated only when its bytes are about to arrive
            if nbytes:
                opener.region(byte_view(t))
            tensors[name] = t
        if isinstance(src, _BytesSource) and not src.at_end():
            raise TrailingDataError("bytes follow the last segment of the tensor message")
        tensors, meta = restore_aliases(tensors, meta)
        # Only a completely authenticated message advances the replay state (re-checked atomically).
        self._admit(key, aead, sender, counter, ts_ms)
        return tensors, meta

    # -- version 1 ----------------------------------------------------------------------------
    def _open_v1(self, msg: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        sender, recipient, session_id, counter, ts_ms, body_at = _parse(msg)
        aead, key = self._session(sender, recipient, session_id, 1)
        header = msg[:body_at]
        try:
            payload = aead.decrypt(_nonce_v1(counter), msg[body_at:], header)
        except InvalidTag:
            raise MessageAuthError(f"message from {sender!r} failed authentication "
                                   "(modified, or not sealed by that sender for us)") from None
        self._admit(key, aead, sender, counter, ts_ms)
        return decode_tensors(payload)

    # -- shared -------------------------------------------------------------------------------
    def _session(self, sender: str, recipient: str, session_id: bytes,
                 version: int) -> tuple[AESGCM, tuple[str, bytes, int]]:
        if recipient != self.identity.party_id:
            raise ReplayError(f"message is addressed to {recipient!r}, not {self.identity.party_id!r}")
        if sender not in self.peers:
            raise KeyNotFoundError(f"unknown sender {sender!r}", hint="add its public key to the peers")
        key = (sender, session_id, version)
        state = self._sessions.get(key)
        if state is not None:
            return state[0], key
        peer_pub = self.peers[sender]
        return _session_key(self.identity._exchange(peer_pub), session_id, sender, recipient, peer_pub,
                            self.identity.public_bytes(), version), key

    def _admit(self, key: tuple[str, bytes, int], aead: AESGCM, sender: str, counter: int, ts_ms: int, *,
               commit: bool = True) -> None:
        """Freshness and replay checks of an authenticated header; with ``commit`` atomically advances the state."""
        if self.max_age_s is not None and abs(time.time() * 1000 - ts_ms) > self.max_age_s * 1000:
            raise ReplayError(f"message {counter} from {sender!r} is outside the {self.max_age_s:.0f}s window")
        with self._lock:
            current = self._sessions.get(key)
            last = current[1] if current is not None else 0
            if counter <= last:
                raise ReplayError(f"message {counter} from {sender!r} replayed or out of order (last was {last})")
            if current is None and ts_ms <= self._evicted_floor_ms.get(sender, -1):
                raise ReplayError(f"message {counter} from {sender!r} belongs to an unknown session that is not newer "
                                  "than a forgotten one (possible replay)", hint="the sender should open a new session")
            if not commit:
                return
            self._sessions[key] = (aead, counter, max(ts_ms, current[2] if current is not None else ts_ms))
            self._sessions.move_to_end(key)
            while len(self._sessions) > self._max_sessions:
                (old_sender, _, _), (_, _, old_ts) = self._sessions.popitem(last=False)
                self._evicted_floor_ms[old_sender] = max(old_ts, self._evicted_floor_ms.get(old_sender, -1))


class _SegmentOpener:
    """Decrypts the v2 segments of one message, in order, into caller-provided memory."""

    def __init__(self, src: Any, aead: AESGCM, counter: int, seg: int, aad: bytes, sender: str) -> None:
        self._src, self._aead, self._counter, self._seg, self._aad = src, aead, counter, seg, aad
        self._sender = sender
        self._index = 1

    def region(self, out: memoryview) -> None:
        seg = self._seg
        for off in range(0, len(out), seg):
            n = min(seg, len(out) - off)
            if self._index > MAX_SEGMENTS:
                raise LimitExceededError("message has more than 2^32-1 segments")
            ct = self._src.take(n + TAG_BYTES, f"segment {self._index}")
            dst = out[off:off + n]
            try:
                self._aead.decrypt_into(_NONCE2.pack(self._counter, self._index), ct, self._aad, dst)
            except InvalidTag:
                dst[:] = bytes(n)  # no unauthenticated plaintext left in a tensor
                raise MessageAuthError(f"segment {self._index} of a message from {self._sender!r} failed "
                                       "authentication (modified, reordered or spliced)") from None
            self._index += 1

    def region_bytes(self, length: int) -> bytearray:
        """A region decrypted into a buffer that grows only by authenticated segments."""
        out = bytearray()
        scratch = memoryview(bytearray(min(self._seg, length)))
        left = length
        while left:
            n = min(self._seg, left)
            self.region(scratch[:n])
            out += scratch[:n]
            left -= n
        return out


def _parse(msg: bytes) -> tuple[str, str, bytes, int, int, int]:
    """Public fields of a message (v1 or v2): sender, recipient, session id, counter, timestamp, header end."""
    try:
        if msg[:4] != MAGIC:
            raise HeaderFormatError("not a securetrain tensor message (bad magic)")
        if msg[4] not in _LABELS:
            raise HeaderFormatError(f"unsupported tensor message version {msg[4]}")
        version = msg[4]
        pos = 5
        slen = msg[pos]
        sender = msg[pos + 1:pos + 1 + slen].decode()
        pos += 1 + slen
        rlen = msg[pos]
        recipient = msg[pos + 1:pos + 1 + rlen].decode()
        pos += 1 + rlen
        session_id = msg[pos:pos + SESSION_ID_BYTES]
        pos += SESSION_ID_BYTES
        counter, ts = struct.unpack(">QQ", msg[pos:pos + 16])
        pos += 16 if version == 1 else _V2_TAIL.size
    except (IndexError, struct.error, UnicodeDecodeError):
        raise TruncatedError("tensor message is truncated or malformed") from None
    if len(msg) < pos + TAG_BYTES or len(session_id) != SESSION_ID_BYTES:
        raise TruncatedError("tensor message is truncated")
    return sender, recipient, session_id, counter, ts, pos


# -- framing over sockets (for v1 messages and other bytes) ---------------------------------------

_LEN = struct.Struct(">Q")
_RECV_CHUNK = 1 << 20


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send one length-prefixed frame (u64 big-endian length, then the bytes)."""
    sock.sendall(_LEN.pack(len(data)))
    sock.sendall(data)


def recv_frame(sock: socket.socket, *, max_bytes: int | None = None) -> bytes | None:
    """Receive one frame; ``None`` on a clean close between frames.

    ``max_bytes`` defaults to :meth:`TransportLimits.from_env` ``.max_message_bytes`` (1 GiB).
    Memory grows with the bytes that actually arrive (from 1 MiB, doubling: at most twice what
    arrived), never with the announced length: a peer announcing 2 GiB and sending little costs little.
    """
    limit = TransportLimits.from_env().max_message_bytes if max_bytes is None else max_bytes
    first = sock.recv(_LEN.size, socket.MSG_WAITALL)
    if not first:
        return None
    if len(first) < _LEN.size:
        first += sock.recv(_LEN.size - len(first), socket.MSG_WAITALL)
        if len(first) < _LEN.size:
            raise TruncatedError("connection closed inside a frame length")
    (length,) = _LEN.unpack(first)
    if length > limit:
        raise LimitExceededError(f"incoming frame of {length} bytes exceeds the {limit}-byte limit")
    # Grow by doubling from 1 MiB as bytes arrive: at most 2x what actually arrived is allocated.
    buf = bytearray(min(length, _RECV_CHUNK))
    got = 0
    while got < length:
        if got == len(buf):
            buf.extend(bytes(min(len(buf), length - len(buf))))
        k = sock.recv_into(memoryview(buf)[got:])
        if not k:
            raise TruncatedError(f"connection closed inside a frame ({got} of {length} bytes)")
        got += k
    return bytes(buf)


# -- torch.distributed ------------------------------------------------------------------------


def dist_send_bytes(data: bytes, dst: int, group: Any = None) -> None:
    """Send sealed bytes to rank ``dst``: an int64 length tensor, then a uint8 tensor."""
    import torch.distributed as dist

    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)


def dist_recv_bytes(src: int, group: Any = None, *, max_bytes: int | None = None) -> bytes:
    import torch.distributed as dist

    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src=src, group=group)
    n = int(length.item())
    max_bytes = TransportLimits.from_env().max_message_bytes if max_bytes is None else max_bytes
    if not 0 <= n <= max_bytes:
        raise LimitExceededError(f"incoming message of {n} bytes exceeds the {max_bytes}-byte limit")
    if n == 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return buf.numpy().tobytes()


# -- functional aliases (the names in the issue) ----------------------------------------------


def seal(tensors: Mapping[str, torch.Tensor], sealer: TensorSealer, metadata: Mapping[str, str] | None = None) -> bytes:
    return sealer.seal(tensors, metadata)


def open(message: bytes | bytearray | memoryview, opener: TensorOpener) -> dict[str, torch.Tensor]:  # noqa: A001
    return opener.open(message)

"""Encrypted, authenticated tensor messages between processes and hosts.

Recipient model (see ``docs/tensor-transport.md``): every party has a static X25519 key pair and
knows its peers' public keys (distributed out of band, like SSH host keys). A sender opens a
*session* with a fresh random 16-byte session id; the session key is
``HKDF-SHA256(X25519(sender, recipient), salt=session_id, info=label|ids|public keys)``, so a
restarted sender never reuses a (key, nonce) pair. Each message carries a strictly increasing
64-bit counter (also the GCM nonce) and a timestamp; the receiver remembers the last counter per
(sender, session) and rejects replays, reordering, expired messages and messages addressed to
someone else - after authentication, before deserializing anything.

Message layout (big-endian)::

    "STTM" | u8 version=1 | u8 len | sender_id | u8 len | recipient_id | 16 session_id
    | u64 counter | u64 timestamp_ms | AES-256-GCM(payload) || 16-byte tag

AAD = every byte before the ciphertext; nonce = 4 zero bytes || u64 counter; payload = safetensors.
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from securetrain.crypto.errors import (
    HeaderFormatError,
    KeyNotFoundError,
    LimitExceededError,
    MessageAuthError,
    ReplayError,
    TruncatedError,
)
from securetrain.crypto.keys import validate_key_id
from securetrain.crypto.safetensors_codec import decode_tensors, encode_tensors
from securetrain.crypto.stream import GCM_MAX_PLAINTEXT_BYTES

MAGIC = b"STTM"
VERSION = 1
TAG_BYTES = 16
SESSION_ID_BYTES = 16
MAX_COUNTER = 2**64 - 1
DEFAULT_MAX_FRAME = 4 << 30
_LABEL = b"securetrain-transport-v1"


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
        return cls(party_id, X25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        """Raw 32-byte private key, for storing in a keyring; handle as a secret."""
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def public_bytes(self) -> bytes:
        return self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def _exchange(self, peer_public: bytes) -> bytes:
        return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))

    def __repr__(self) -> str:
        return f"TransportIdentity(party_id={self.party_id!r}, public={self.public_bytes().hex()[:16]}...)"

    __str__ = __repr__

    def __reduce__(self) -> object:
        raise TypeError("TransportIdentity cannot be pickled (it holds a private key)")


def _ids(sender: str, recipient: str) -> bytes:
    s, r = sender.encode(), recipient.encode()
    return struct.pack(">B", len(s)) + s + struct.pack(">B", len(r)) + r


def _session_key(shared: bytes, session_id: bytes, sender: str, recipient: str,
                 sender_pub: bytes, recipient_pub: bytes) -> AESGCM:
    if shared == bytes(32):
        raise MessageAuthError("X25519 produced the all-zero secret (low-order peer key); refused")
    info = _LABEL + _ids(sender, recipient) + sender_pub + recipient_pub
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=info).derive(shared))


class TensorSealer:
    """Seals tensor dicts from ``identity`` to one recipient; one instance = one session."""

    def __init__(self, identity: TransportIdentity, recipient_id: str, recipient_public: bytes) -> None:
        self.identity = identity
        self.recipient_id = validate_key_id(recipient_id)
        self.session_id = secrets.token_bytes(SESSION_ID_BYTES)
        self._aead = _session_key(identity._exchange(recipient_public), self.session_id, identity.party_id,
                                  recipient_id, identity.public_bytes(), recipient_public)
        self._prefix = MAGIC + bytes([VERSION]) + _ids(identity.party_id, recipient_id) + self.session_id
        self._counter = 0
        self._lock = threading.Lock()  # the counter is the GCM nonce: it must never repeat, even across threads

    def seal(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
        payload = encode_tensors(tensors, metadata)
        if len(payload) > GCM_MAX_PLAINTEXT_BYTES:
            raise LimitExceededError("message exceeds the AES-GCM limit of 2^39-256 bits; split it")
        with self._lock:
            if self._counter >= MAX_COUNTER:
                raise LimitExceededError("message counter exhausted; open a new session (new TensorSealer)")
            self._counter += 1
            counter = self._counter
        header = self._prefix + struct.pack(">QQ", counter, int(time.time() * 1000))
        nonce = bytes(4) + struct.pack(">Q", counter)
        return header + self._aead.encrypt(nonce, payload, header)

    def __repr__(self) -> str:
        return f"TensorSealer({self.identity.party_id!r} -> {self.recipient_id!r}, sent={self._counter})"


class TensorOpener:
    """Opens messages addressed to ``identity`` from known ``peers`` ({party_id: public key})."""

    def __init__(self, identity: TransportIdentity, peers: Mapping[str, bytes], *,
                 max_age_s: float | None = 600.0, max_sessions: int = 4096) -> None:
        self.identity = identity
        self.peers = dict(peers)
        self.max_age_s = max_age_s
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, bytes], tuple[AESGCM, int, int]] = OrderedDict()
        # Per sender, the newest timestamp of any session we forgot: a message of an unknown
        # session that is not newer could be a replay from an evicted one, so it is refused.
        self._evicted_floor_ms: dict[str, int] = {}
        self._lock = threading.Lock()

    def open(self, message: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
        return self.open_with_metadata(message)[0]

    def open_with_metadata(
        self, message: bytes | bytearray | memoryview
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        msg = bytes(message)
        sender, recipient, session_id, counter, ts_ms, body_at = _parse(msg)
        if recipient != self.identity.party_id:
            raise ReplayError(f"message is addressed to {recipient!r}, not {self.identity.party_id!r}")
        if sender not in self.peers:
            raise KeyNotFoundError(f"unknown sender {sender!r}", hint="add its public key to the peers")
        key = (sender, session_id)
        state = self._sessions.get(key)
        if state is None:
            peer_pub = self.peers[sender]
            aead = _session_key(self.identity._exchange(peer_pub), session_id, sender, recipient, peer_pub,
                                self.identity.public_bytes())
        else:
            aead = state[0]
        header = msg[:body_at]
        try:
            payload = aead.decrypt(bytes(4) + struct.pack(">Q", counter), msg[body_at:], header)
        except InvalidTag:
            raise MessageAuthError(f"message from {sender!r} failed authentication "
                                   "(modified, or not sealed by that sender for us)") from None
        if self.max_age_s is not None and abs(time.time() * 1000 - ts_ms) > self.max_age_s * 1000:
            raise ReplayError(f"message {counter} from {sender!r} is outside the {self.max_age_s:.0f}s window")
        # Only authenticated messages may consult or advance replay state; check-and-advance is
        # atomic so two threads cannot both accept the same message.
        with self._lock:
            current = self._sessions.get(key)
            last = current[1] if current is not None else 0
            if counter <= last:
                raise ReplayError(f"message {counter} from {sender!r} replayed or out of order (last was {last})")
            if current is None and ts_ms <= self._evicted_floor_ms.get(sender, -1):
                raise ReplayError(f"message {counter} from {sender!r} belongs to an unknown session that is not newer "
                                  "than a forgotten one (possible replay)", hint="the sender should open a new session")
            self._sessions[key] = (aead, counter, max(ts_ms, current[2] if current is not None else ts_ms))
            self._sessions.move_to_end(key)
            while len(self._sessions) > self._max_sessions:
                (old_sender, _), (_, _, old_ts) = self._sessions.popitem(last=False)
                self._evicted_floor_ms[old_sender] = max(old_ts, self._evicted_floor_ms.get(old_sender, -1))
        return decode_tensors(payload)


def _parse(msg: bytes) -> tuple[str, str, bytes, int, int, int]:
    try:
        if msg[:4] != MAGIC:
            raise HeaderFormatError("not a securetrain tensor message (bad magic)")
        if msg[4] != VERSION:
            raise HeaderFormatError(f"unsupported tensor message version {msg[4]}")
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
        pos += 16
    except (IndexError, struct.error, UnicodeDecodeError):
        raise TruncatedError("tensor message is truncated or malformed") from None
    if len(msg) < pos + TAG_BYTES or len(session_id) != SESSION_ID_BYTES:
        raise TruncatedError("tensor message is truncated")
    return sender, recipient, session_id, counter, ts, pos


# -- framing over sockets -------------------------------------------------------------------

_LEN = struct.Struct(">Q")


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send one length-prefixed frame (u64 big-endian length, then the bytes)."""
    sock.sendall(_LEN.pack(len(data)))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TruncatedError(f"connection closed inside a frame ({got} of {n} bytes)")
        got += k
    return buf


def recv_frame(sock: socket.socket, *, max_bytes: int = DEFAULT_MAX_FRAME) -> bytes | None:
    """Receive one frame; ``None`` on a clean close between frames. Oversized frames are refused."""
    first = sock.recv(_LEN.size, socket.MSG_WAITALL)
    if not first:
        return None
    if len(first) < _LEN.size:
        first += bytes(_recv_exact(sock, _LEN.size - len(first)))
    (length,) = _LEN.unpack(first)
    if length > max_bytes:
        raise LimitExceededError(f"incoming frame of {length} bytes exceeds the {max_bytes}-byte limit")
    return bytes(_recv_exact(sock, length))


# -- torch.distributed ------------------------------------------------------------------------


def dist_send_bytes(data: bytes, dst: int, group: Any = None) -> None:
    """Send sealed bytes to rank ``dst``: an int64 length tensor, then a uint8 tensor."""
    import torch.distributed as dist

    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)


def dist_recv_bytes(src: int, group: Any = None, *, max_bytes: int = DEFAULT_MAX_FRAME) -> bytes:
    import torch.distributed as dist

    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src=src, group=group)
    n = int(length.item())
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

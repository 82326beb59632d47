"""Streaming AEAD container (format v2, reads v1): AES-256-GCM segments under an HKDF-SHA256 file key.

Byte layout, key schedule and the reader's checks are specified in ``docs/checkpoint-format.md``;
keep the two in sync. In short::

    fixed header         magic | version | alg | segment_size | plaintext_length | salt | nonce_prefix
                         v2 only: flags | u16 context_len | context (e.g. store id + step of a checkpoint)
    key stanzas          count | (key_id, wrap_alg, kek fingerprint, wrapped data key)*
    commitment (32 B)    HKDF(data_key, salt, "commitment")        -> wrong key fails before decrypting
    header MAC (32 B)    HMAC-SHA256(HKDF(.., "header-mac"), all header bytes before the MAC)
    segments             AES-256-GCM(payload_key, prefix|u32 counter|u8 last, pt, aad=SHA256(fixed|ad))
    signature (72 B)     v2 with flag SIGNED: signer fingerprint | Ed25519(fixed | commitment | SHA256(segments))

Only the fixed header is bound into the segments, so re-wrapping the data key for a new KEK
(rotation) rewrites the stanzas and MAC but leaves every segment byte unchanged.

The plaintext length is declared up front, so the reader knows exactly where the final segment
ends: truncation, appended segments and trailing bytes are told apart (each its own error type)
and, for seekable inputs, detected before any plaintext is produced. A segment's plaintext is never
returned before its tag verified.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from securetrain.audit.recorder import AuditRecorder
from securetrain.crypto.errors import (
    HeaderAuthError,
    HeaderFormatError,
    KeyNotFoundError,
    LimitExceededError,
    SegmentAuthError,
    SignatureError,
    TrailingDataError,
    TruncatedError,
    WrongKeyError,
)
from securetrain.crypto.keys import FINGERPRINT_BYTES, KEY_ID_RE, WRAP_AES256_KW, WRAP_OPAQUE, KeyProvider
from securetrain.crypto.private_file import private_writer
from securetrain.errors import IntegrityError

MAGIC = b"\x89STENC\r\n"
VERSION = 2  # written; 1 and 2 are read
READ_VERSIONS = (1, 2)
FLAG_SIGNED = 0x01  # v2 flags: a 72-byte Ed25519 signature trailer follows the final segment
KNOWN_FLAGS = FLAG_SIGNED
V2_EXTRA = struct.Struct(">BH")  # flags, context_length
MAX_CONTEXT_BYTES = 1024
SIGNER_FINGERPRINT_BYTES = 8
SIGNATURE_BYTES = 64
TRAILER_BYTES = SIGNER_FINGERPRINT_BYTES + SIGNATURE_BYTES
_SIG_LABEL = b"securetrain-container-signature-v2\x00"
ALG_AES256GCM_HKDF_SHA256 = 1
ALGORITHMS = {ALG_AES256GCM_HKDF_SHA256: "AES-256-GCM-HKDF-SHA256 (segmented, Tink nonce layout)"}

FIXED = struct.Struct(">8sBBIQ32s7s")  # magic, version, alg, segment_size, plaintext_length, salt, prefix
# (v2 appends flags, context_length and the context to these 61 bytes; all of it is the "fixed header")
SALT_BYTES = 32
PREFIX_BYTES = 7
TAG_BYTES = 16
COMMIT_BYTES = 32
MAC_BYTES = 32
DEFAULT_SEGMENT_SIZE = 1 << 20
MIN_SEGMENT_SIZE = 16
MAX_SEGMENT_SIZE = 1 << 26  # 64 MiB, far below the GCM per-call limit below
MAX_SEGMENTS = 1 << 32  # 32-bit counter in the nonce
MAX_STANZAS = 16
MAX_WRAPPED_BYTES = 4096
# NIST SP 800-38D: at most 2^39 - 256 bits of plaintext per GCM invocation.
GCM_MAX_PLAINTEXT_BYTES = (2**39 - 256) // 8
assert MAX_SEGMENT_SIZE <= GCM_MAX_PLAINTEXT_BYTES

_LABEL = b"securetrain-stream-v1 "
_SEG_NONCE = struct.Struct(">IB")


@dataclass(frozen=True)
class Stanza:
    """One wrapped copy of the data key. Public: key id, algorithm, KEK fingerprint, wrapped bytes."""

    key_id: str
    wrap_alg: int
    fingerprint: bytes
    wrapped: bytes

    def encode(self) -> bytes:
        kid = self.key_id.encode()
        return (struct.pack(">B", len(kid)) + kid + struct.pack(">B", self.wrap_alg)
                + self.fingerprint + struct.pack(">H", len(self.wrapped)) + self.wrapped)


@dataclass(frozen=True)
class Header:
    version: int
    algorithm: int
    segment_size: int
    plaintext_length: int
    salt: bytes
    nonce_prefix: bytes
    stanzas: tuple[Stanza, ...]
    commitment: bytes
    mac: bytes
    fixed: bytes  # the fixed-header bytes (61 in v1, 64 + context in v2), bound into every segment
    raw: bytes  # the whole header as stored
    flags: int = 0
    context: bytes = b""  # v2: public, authenticated binding (the checkpoint store: store id + step)

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)

    @property
    def trailer_length(self) -> int:
        return TRAILER_BYTES if self.signed else 0

    @property
    def header_length(self) -> int:
        return len(self.raw)

    @property
    def segment_count(self) -> int:
        return segment_count(self.plaintext_length, self.segment_size)

    @property
    def payload_length(self) -> int:
        return self.plaintext_length + self.segment_count * TAG_BYTES

    @property
    def total_length(self) -> int:
        return self.header_length + self.payload_length + self.trailer_length

    @property
    def key_ids(self) -> list[str]:
        return [s.key_id for s in self.stanzas]

    def describe(self) -> dict[str, object]:
        """Public fields only (safe to print/log): no data key, no wrapped bytes."""
        return {
            "format_version": self.version,
            "signed": self.signed,
            "context": self.context.decode("utf-8", "replace"),
            "algorithm": ALGORITHMS.get(self.algorithm, str(self.algorithm)),
            "segment_size": self.segment_size,
            "segments": self.segment_count,
            "plaintext_bytes": self.plaintext_length,
            "header_bytes": self.header_length,
            "total_bytes": self.total_length,
            "keys": [{"key_id": s.key_id, "wrap": {WRAP_AES256_KW: "AES-256-KW", WRAP_OPAQUE: "kms"}.get(
                s.wrap_alg, str(s.wrap_alg)), "kek_fingerprint": s.fingerprint.hex()} for s in self.stanzas],
        }


def segment_count(plaintext_length: int, segment_size: int) -> int:
    """Segments used for ``plaintext_length`` bytes: at least one (an empty payload has one empty segment)."""
    return max(1, -(-plaintext_length // segment_size))


@dataclass(frozen=True, repr=False)  # holds key material: no field-printing repr
class _Keys:
    payload: AESGCM
    mac_key: bytes
    commitment: bytes


def _hkdf(data_key: bytes, salt: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=_LABEL + label).derive(data_key)


def _derive(data_key: bytes, salt: bytes) -> _Keys:
    return _Keys(AESGCM(_hkdf(data_key, salt, b"payload")), _hkdf(data_key, salt, b"header-mac"),
                 _hkdf(data_key, salt, b"commitment"))


def _segment_aad(fixed: bytes, associated_data: bytes) -> bytes:
    return hashlib.sha256(fixed + struct.pack(">Q", len(associated_data)) + associated_data).digest()


def signer_fingerprint(public_key: Ed25519PublicKey) -> bytes:
    """8-byte public identifier of a container-signing key (stored in the signature trailer)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(b"securetrain signer fingerprint v1\x00" + raw).digest()[:SIGNER_FINGERPRINT_BYTES]


def _signed_message(fixed: bytes, commitment: bytes, segments_sha256: bytes) -> bytes:
    return _SIG_LABEL + fixed + commitment + segments_sha256


def _wrap_stanza(provider: KeyProvider, key_id: str, data_key: bytes) -> Stanza:
    wrapped = provider.wrap(key_id, data_key)
    if len(wrapped) > MAX_WRAPPED_BYTES:
        raise LimitExceededError(f"wrapped data key from {key_id!r} is {len(wrapped)} bytes (max {MAX_WRAPPED_BYTES})")
    fp_fn = getattr(provider, "fingerprint_of", None)
    fp = (fp_fn(key_id) if fp_fn else None) or bytes(FINGERPRINT_BYTES)
    wrap_alg = int(getattr(provider, "wrap_alg", WRAP_OPAQUE))
    if wrap_alg not in (WRAP_AES256_KW, WRAP_OPAQUE):
        raise LimitExceededError(f"provider declares unknown wrap_alg {wrap_alg}")
    return Stanza(key_id, wrap_alg, fp, wrapped)


def _assemble(fixed: bytes, stanzas: tuple[Stanza, ...], keys: _Keys) -> bytes:
    body = fixed + struct.pack(">B", len(stanzas)) + b"".join(s.encode() for s in stanzas) + keys.commitment
    return body + hmac.new(keys.mac_key, body, hashlib.sha256).digest()


# ---------------------------------------------------------------------------------------------
# Header parsing and opening
# ---------------------------------------------------------------------------------------------


def _read_exact(src: BinaryIO, n: int, what: str) -> bytes:
    buf = bytearray(n)
    got = readinto_full(src, memoryview(buf))
    if got != n:
        raise TruncatedError(f"input ends inside the {what} ({got} of {n} bytes)",
                             hint="the file was cut short (interrupted copy or write)")
    return bytes(buf)


def readinto_full(src: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``src``, tolerating short reads (pipes, sockets); return bytes read."""
    total = 0
    size = len(view)
    readinto = getattr(src, "readinto", None)
    while total < size:
        if readinto is not None:
            n = readinto(view[total:])
        else:
            chunk = src.read(size - total)
            n = len(chunk)
            view[total:total + n] = chunk
        if not n:
            break
        total += n
    return total


def read_header(src: BinaryIO) -> Header:
    """Parse (not authenticate) a header; leaves ``src`` positioned at the first segment."""
    fixed = _read_exact(src, FIXED.size, "fixed header")
    magic, version, alg, seg, length, salt, prefix = FIXED.unpack(fixed)
    if magic != MAGIC:
        raise HeaderFormatError("not a securetrain encrypted container (bad magic)",
                                hint="is this a plain safetensors/torch file or another format?")
    if version not in READ_VERSIONS:
        raise HeaderFormatError(f"unsupported container version {version} (this build reads 1 and 2)")
    if alg not in ALGORITHMS:
        raise HeaderFormatError(f"unknown algorithm id {alg}")
    if not MIN_SEGMENT_SIZE <= seg <= MAX_SEGMENT_SIZE:
        raise HeaderFormatError(f"segment size {seg} outside [{MIN_SEGMENT_SIZE}, {MAX_SEGMENT_SIZE}]")
    if segment_count(length, seg) > MAX_SEGMENTS:
        raise HeaderFormatError(f"declared plaintext length {length} needs more than 2^32 segments")
    flags, context = 0, b""
    if version >= 2:
        extra = _read_exact(src, V2_EXTRA.size, "fixed header")
        flags, clen = V2_EXTRA.unpack(extra)
        if flags & ~KNOWN_FLAGS:
            raise HeaderFormatError(f"unknown header flags 0x{flags:02x}")
        if clen > MAX_CONTEXT_BYTES:
            raise HeaderFormatError(f"context of {clen} bytes exceeds {MAX_CONTEXT_BYTES}")
        context = _read_exact(src, clen, "header context")
        fixed += extra + context
    (count,) = _read_exact(src, 1, "stanza count")
    if not 1 <= count <= MAX_STANZAS:
        raise HeaderFormatError(f"invalid key stanza count {count}")
    parts = [fixed, bytes([count])]
    stanzas = []
    for _ in range(count):
        (kid_len,) = raw_len = _read_exact(src, 1, "key stanza")
        if kid_len == 0:
            raise HeaderFormatError("empty key id in stanza")
        kid = _read_exact(src, kid_len, "key stanza")
        rest = _read_exact(src, 1 + FINGERPRINT_BYTES + 2, "key stanza")
        wrap_alg = rest[0]
        if wrap_alg not in (WRAP_AES256_KW, WRAP_OPAQUE):
            raise HeaderFormatError(f"unknown wrap_alg {wrap_alg} in key stanza")
        fp = rest[1:1 + FINGERPRINT_BYTES]
        (wlen,) = struct.unpack(">H", rest[-2:])
        if not 1 <= wlen <= MAX_WRAPPED_BYTES:
            raise HeaderFormatError(f"invalid wrapped key length {wlen}")
        wrapped = _read_exact(src, wlen, "key stanza")
        try:
            key_id = kid.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderFormatError("key id is not UTF-8") from None
        if not KEY_ID_RE.fullmatch(key_id):  # ids get printed: no control characters or markup
            raise HeaderFormatError("key id contains characters outside [A-Za-z0-9._:/@-]")
        stanzas.append(Stanza(key_id, wrap_alg, fp, wrapped))
        parts += [raw_len, kid, rest, wrapped]
    commitment = _read_exact(src, COMMIT_BYTES, "key commitment")
    mac = _read_exact(src, MAC_BYTES, "header MAC")
    raw = b"".join(parts) + commitment + mac
    return Header(version, alg, seg, length, salt, prefix, tuple(stanzas), commitment, mac, fixed, raw,
                  flags, context)


def unwrap_data_key(header: Header, provider: KeyProvider) -> bytes:
    """Find a stanza ``provider`` can open, unwrap it, check the key commitment and the header MAC."""
    return _unwrap(header, provider)[0]


def _unwrap(header: Header, provider: KeyProvider) -> tuple[bytes, int]:
    data_key: bytes | None = None
    failure: Exception | None = None
    opened = -1
    for index, stanza in enumerate(header.stanzas):
        try:
            candidate = provider.unwrap(stanza.key_id, stanza.wrapped)
        except KeyNotFoundError as exc:
            failure = failure or exc
            continue
        except WrongKeyError as exc:
            failure = exc
            continue
        if len(candidate) != 32:
            failure = WrongKeyError(f"key {stanza.key_id!r} unwrapped to a {len(candidate)}-byte key")
            continue
        data_key, opened = candidate, index
        break
    if data_key is None:
        if isinstance(failure, WrongKeyError) and not isinstance(failure, KeyNotFoundError):
            raise failure
        raise KeyNotFoundError(
            f"none of the file's keys ({', '.join(header.key_ids)}) is available",
            hint="load the keyring that wrote it; rotated files name the new key id")
    keys = _derive(data_key, header.salt)
    # Key commitment first: a wrong (or substituted) data key fails here, before any decryption.
    if not hmac.compare_digest(keys.commitment, header.commitment):
        raise WrongKeyError("the data key does not match the file's key commitment",
                            hint="wrong key, or the header salt/commitment was modified")
    body = header.raw[:-MAC_BYTES]
    if not hmac.compare_digest(hmac.new(keys.mac_key, body, hashlib.sha256).digest(), header.mac):
        raise HeaderAuthError("container header failed authentication (it was modified)")
    return data_key, opened


def open_header(src: BinaryIO, provider: KeyProvider) -> tuple[Header, bytes]:
    header = read_header(src)
    return header, unwrap_data_key(header, provider)


# ---------------------------------------------------------------------------------------------
# Encryption
# ---------------------------------------------------------------------------------------------


class EncryptingWriter:
    """Write-only stream that encrypts exactly ``length`` plaintext bytes into ``dst``.

    Memory: one segment of plaintext and one of ciphertext, preallocated. Writes of whole segments
    are encrypted straight from the caller's buffer (no copy). ``close()`` fails if fewer than
    ``length`` bytes were written; the output is then incomplete and must be discarded.
    """

    def __init__(
        self,
        dst: BinaryIO,
        provider: KeyProvider,
        length: int,
        *,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        associated_data: bytes = b"",
        key_id: str | None = None,
        recipients: Sequence[tuple[KeyProvider, str | None]] = (),
        context: bytes = b"",
        signer: Ed25519PrivateKey | None = None,
        _fixed_randomness: tuple[bytes, bytes, bytes] | None = None,  # test vectors only
        _version: int = VERSION,  # 1: legacy files for tests; no context, no signature
    ) -> None:
        if not MIN_SEGMENT_SIZE <= segment_size <= MAX_SEGMENT_SIZE:
            raise LimitExceededError(f"segment size must be in [{MIN_SEGMENT_SIZE}, {MAX_SEGMENT_SIZE}]")
        if length < 0 or length >= 1 << 64:
            raise LimitExceededError(f"invalid plaintext length {length}")
        self._n = segment_count(length, segment_size)
        if self._n > MAX_SEGMENTS:
            raise LimitExceededError(
                f"{length} bytes need {self._n} segments of {segment_size} bytes; the 32-bit segment "
                "counter allows 2^32", hint="use a larger segment size")
        if _fixed_randomness is not None:
            data_key, salt, prefix = _fixed_randomness
        else:
            data_key, salt, prefix = secrets.token_bytes(32), secrets.token_bytes(SALT_BYTES), \
                secrets.token_bytes(PREFIX_BYTES)
        fixed = FIXED.pack(MAGIC, _version, ALG_AES256GCM_HKDF_SHA256, segment_size, length, salt, prefix)
        if _version >= 2:
            if len(context) > MAX_CONTEXT_BYTES:
                raise LimitExceededError(f"context of {len(context)} bytes exceeds {MAX_CONTEXT_BYTES}")
            fixed += V2_EXTRA.pack(FLAG_SIGNED if signer is not None else 0, len(context)) + bytes(context)
        elif context or signer is not None:
            raise ValueError("format v1 has no context or signature")
        keys = _derive(data_key, salt)
        kid = key_id or provider.current_key_id()
        stanzas = [_wrap_stanza(provider, kid, data_key)]
        # Extra recipients (e.g. a Vault break-glass key): the same data key, wrapped again.
        stanzas += [_wrap_stanza(p, k or p.current_key_id(), data_key) for p, k in recipients]
        if len(stanzas) > MAX_STANZAS:
            raise LimitExceededError(f"at most {MAX_STANZAS} key stanzas per file")
        raw = _assemble(fixed, tuple(stanzas), keys)
        self.header = read_header(io.BytesIO(raw))
        self.key_id = kid
        self._dst = dst
        self._aead = keys.payload
        self._aad = _segment_aad(fixed, associated_data)
        self._signer = signer
        self._sig_hash = hashlib.sha256() if signer is not None else None
        self._prefix = prefix
        self._seg = segment_size
        self._length = length
        self._last_len = length - (self._n - 1) * segment_size
        self._pt = bytearray(segment_size)
        self._ptv = memoryview(self._pt)
        self._ct = bytearray(segment_size + TAG_BYTES)
        self._ctv = memoryview(self._ct)
        self._index = 0
        self._fill = 0
        self._written = 0
        self._closed = False
        # Set by any failure. The segment that failed may already be partly in ``dst`` under nonce
        # i; encrypting a retry under the same nonce would void GCM, so the writer stays unusable.
        self._failed = False
        # The segment index is the nonce counter: serialize writers so it can never be reused.
        self._lock = threading.Lock()
        dst.write(raw)

    def _guarded(self, fn, *args):  # type: ignore[no-untyped-def]
        with self._lock:
            if self._failed:
                raise ValueError("EncryptingWriter failed earlier; its output is incomplete and must be discarded")
            try:
                return fn(*args)
            except BaseException:
                self._failed = True
                raise

    def _need(self) -> int:
        return self._last_len if self._index == self._n - 1 else self._seg

    def _emit(self, plaintext: memoryview) -> None:
        last = self._index == self._n - 1
        nonce = self._prefix + _SEG_NONCE.pack(self._index, 1 if last else 0)
        out = self._ctv[: len(plaintext) + TAG_BYTES]
        self._aead.encrypt_into(nonce, plaintext, self._aad, out)
        if self._sig_hash is not None:
            self._sig_hash.update(out)
        self._dst.write(out)
        self._index += 1

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._guarded(self._write, data)  # type: ignore[no-any-return]

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError("write to a closed EncryptingWriter")
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
        size = len(view)
        if self._written + size > self._length:
            raise LimitExceededError(f"writing {size} more bytes exceeds the declared length {self._length}")
        self._written += size
        while len(view):
            need = self._need()
            if self._fill == 0 and len(view) >= need:
                self._emit(view[:need])  # zero-copy fast path
                view = view[need:]
                continue
            take = min(len(view), need - self._fill)
            self._ptv[self._fill:self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == need:
                self._emit(self._ptv[:need])
                self._fill = 0
        return size

    def fill_from(self, src: BinaryIO) -> None:
        """Encrypt everything remaining in ``src`` (``readinto`` into the segment buffer, no copies)."""
        self._guarded(self._fill_from, src)

    def _fill_from(self, src: BinaryIO) -> None:
        while self._index < self._n:
            need = self._need()
            got = readinto_full(src, self._ptv[self._fill:need])
            self._fill += got
            self._written += got
            if self._fill < need:
                raise TruncatedError(f"source ended after {self._written} of {self._length} declared bytes")
            self._emit(self._ptv[:need])
            self._fill = 0
        if src.read(1):
            raise LimitExceededError(f"source has more than the declared {self._length} bytes")

    def close(self) -> None:
        if self._closed:
            return
        self._guarded(self._close)

    def _close(self) -> None:
        if self._closed:
            return
        if self._index == self._n - 1 and self._need() == 0:
            self._emit(self._ptv[:0])  # empty payload: one empty final segment
        if self._index != self._n or self._written != self._length:
            raise TruncatedError(f"only {self._written} of the declared {self._length} bytes were written; "
                                 "the output is incomplete")
        if self._signer is not None and self._sig_hash is not None:
            message = _signed_message(self.header.fixed, self.header.commitment, self._sig_hash.digest())
            self._dst.write(signer_fingerprint(self._signer.public_key()) + self._signer.sign(message))
        self._closed = True

    def __enter__(self) -> EncryptingWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()


# ---------------------------------------------------------------------------------------------
# Decryption
# ---------------------------------------------------------------------------------------------


class DecryptingReader(io.RawIOBase):
    """Read-only stream over an authenticated container.

    The constructor parses and authenticates the header (key, commitment, MAC) and, when ``src``
    is seekable, checks its size against the declared length - so truncation and trailing data
    fail before any plaintext. Plaintext is released one verified segment at a time.
    """

    def __init__(self, src: BinaryIO, provider: KeyProvider, *, associated_data: bytes = b"",
                 verify_keys: Sequence[Ed25519PublicKey] = ()) -> None:
        super().__init__()
        self.header, data_key = open_header(src, provider)
        self._src = src
        h = self.header
        # With verify_keys a signature by one of them is required (checked at the final segment);
        # refuse an unsigned file before decrypting anything.
        self._verify_keys = {signer_fingerprint(k): k for k in verify_keys}
        if self._verify_keys and not h.signed:
            raise SignatureError("container is not signed, and a writer signature is required",
                                 hint="it was written without a signing key, or the signature was stripped")
        self._sig_hash = hashlib.sha256() if self._verify_keys else None
        self.signer: bytes | None = None  # fingerprint of the verified signer, once verified
        keys = _derive(data_key, h.salt)
        del data_key
        self._aead = keys.payload
        self._aad = _segment_aad(h.fixed, associated_data)
        self._n = h.segment_count
        self._last_len = h.plaintext_length - (self._n - 1) * h.segment_size
        self._ct = bytearray(h.segment_size + TAG_BYTES)
        self._ctv = memoryview(self._ct)
        self._pt = bytearray(h.segment_size)
        self._ptv = memoryview(self._pt)
        self._index = 0
        self._pos = 0  # read position inside the current plaintext segment
        self._avail = 0
        self._check_size()

    def _check_size(self) -> None:
        try:
            if not self._src.seekable():
                return
            here = self._src.tell()
            end = self._src.seek(0, os.SEEK_END)
            self._src.seek(here)
        except (OSError, AttributeError, ValueError):
            return
        have, want = end - here, self.header.payload_length + self.header.trailer_length
        if have < want:
            raise TruncatedError(f"payload is {want - have} bytes shorter than declared "
                                 f"({have} of {want}): final segment(s) missing",
                                 hint="the file was cut short; restore it from a good copy")
        if have > want:
            raise TrailingDataError(f"{have - want} bytes follow the final segment (appended or duplicated data)")

    def segments(self) -> Iterator[memoryview]:
        """Yield each verified segment's plaintext (a view valid until the next iteration)."""
        while self._index < self._n:
            yield self._next_segment()

    def _segment_length(self, i: int) -> int:
        return self._last_len if i == self._n - 1 else self.header.segment_size

    def _next_segment(self, into: memoryview | None = None) -> memoryview:
        """Read, verify and decrypt the next segment into ``into`` (default: the internal buffer)."""
        i = self._index
        last = i == self._n - 1
        pt_len = self._segment_length(i)
        ct = self._ctv[: pt_len + TAG_BYTES]
        got = readinto_full(self._src, ct)
        if got != len(ct):
            raise TruncatedError(f"input ends inside segment {i} of {self._n} ({got} of {len(ct)} bytes)")
        nonce = self.header.nonce_prefix + _SEG_NONCE.pack(i, 1 if last else 0)
        out = self._ptv[:pt_len] if into is None else into
        try:
            self._aead.decrypt_into(nonce, ct, self._aad, out)
        except InvalidTag:
            out[:] = bytes(len(out))  # never leave unverified plaintext in a caller's buffer
            raise SegmentAuthError(f"segment {i} of {self._n} failed authentication "
                                   "(modified, reordered, duplicated or from another file)") from None
        if self._sig_hash is not None:
            self._sig_hash.update(ct)
        if last:
            try:
                self._finish()
            except IntegrityError:
                out[:] = bytes(len(out))
                raise
        self._index += 1
        return out

    def _finish(self) -> None:
        """After the final segment: the signature trailer (if any), then end of input."""
        h = self.header
        if h.signed:
            trailer = _read_exact(self._src, TRAILER_BYTES, "signature trailer")
            if self._sig_hash is not None:
                fp, sig = trailer[:SIGNER_FINGERPRINT_BYTES], trailer[SIGNER_FINGERPRINT_BYTES:]
                key = self._verify_keys.get(fp)
                if key is None:
                    raise SignatureError(f"container is signed by an unknown key (fingerprint {fp.hex()})",
                                         hint="add the writer's public key to the verify keys")
                try:
                    key.verify(sig, _signed_message(h.fixed, h.commitment, self._sig_hash.digest()))
                except InvalidSignature:
                    raise SignatureError("container signature does not verify (content or header changed "
                                         "after signing, or a forged trailer)") from None
                self.signer = fp
        if self._src.read(1):
            raise TrailingDataError("data follows the final segment")

    # io.RawIOBase interface, so the plaintext can be consumed like a file.
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        written = 0
        while written < len(view):
            if self._pos == self._avail:
                if self._index >= self._n:
                    break
                pt_len = self._segment_length(self._index)
                if 0 < pt_len <= len(view) - written:  # whole segment fits: decrypt in place, no copy
                    self._next_segment(into=view[written:written + pt_len])
                    written += pt_len
                    continue
                self._avail = len(self._next_segment())
                self._pos = 0
                continue
            take = min(len(view) - written, self._avail - self._pos)
            view[written:written + take] = self._ptv[self._pos:self._pos + take]
            self._pos += take
            written += take
        return written

    @property
    def finished(self) -> bool:
        return self._index >= self._n and self._pos == self._avail


# ---------------------------------------------------------------------------------------------
# Convenience: streams, bytes, files, re-wrapping
# ---------------------------------------------------------------------------------------------


def _stream_length(src: BinaryIO) -> int:
    try:
        here = src.tell()
        end = src.seek(0, os.SEEK_END)
        src.seek(here)
        return end - here
    except (OSError, AttributeError, ValueError):
        raise LimitExceededError("cannot determine the plaintext length of a non-seekable source",
                                 hint="pass length=<bytes>") from None


def encrypt_stream(src: BinaryIO, dst: BinaryIO, provider: KeyProvider, *, length: int | None = None,
                   segment_size: int = DEFAULT_SEGMENT_SIZE, associated_data: bytes = b"",
                   key_id: str | None = None,
                   recipients: Sequence[tuple[KeyProvider, str | None]] = (),
                   context: bytes = b"", signer: Ed25519PrivateKey | None = None) -> Header:
    """Encrypt ``src`` (``length`` bytes, default: the rest of a seekable source) into ``dst``.

    The data key is wrapped under ``provider`` (``key_id`` or its current key) and, optionally,
    under each extra ``(provider, key_id)`` in ``recipients``; any one of them can decrypt.
    """
    size = _stream_length(src) if length is None else length
    writer = EncryptingWriter(dst, provider, size, segment_size=segment_size,
                              associated_data=associated_data, key_id=key_id, recipients=recipients,
                              context=context, signer=signer)
    if isinstance(src, io.BytesIO):
        _encrypt_in_memory(src, writer, size)
    else:
        writer.fill_from(src)
    writer.close()
    return writer.header


def _encrypt_in_memory(src: io.BytesIO, writer: EncryptingWriter, size: int) -> None:
    """An in-memory source is encrypted straight from its buffer (no copy into the segment buffer:
    the same cost as raw AES-GCM); same length checks as ``fill_from``."""
    pos = src.tell()
    with src.getbuffer() as whole:
        available = len(whole) - pos
        if available < size:
            writer._failed = True  # noqa: SLF001 - the output is incomplete, like fill_from's failure
            raise TruncatedError(f"source ended after {max(0, available)} of {size} declared bytes")
        if available > size:
            writer._failed = True  # noqa: SLF001
            raise LimitExceededError(f"source has more than the declared {size} bytes")
        with whole[pos:pos + size] as view:
            writer.write(view)
    src.seek(pos + size)


def decrypt_stream(src: BinaryIO, dst: BinaryIO | None, provider: KeyProvider, *,
                   associated_data: bytes = b"", verify_keys: Sequence[Ed25519PublicKey] = ()) -> Header:
    """Authenticate and decrypt ``src`` into ``dst`` (``None``: verify only, write nothing).

    With ``verify_keys`` the container must carry a valid signature by one of them.
    """
    reader = DecryptingReader(src, provider, associated_data=associated_data, verify_keys=verify_keys)
    for plaintext in reader.segments():
        if dst is not None:
            dst.write(plaintext)
    return reader.header


def verify_stream(src: BinaryIO, provider: KeyProvider, *, associated_data: bytes = b"",
                  verify_keys: Sequence[Ed25519PublicKey] = ()) -> Header:
    return decrypt_stream(src, None, provider, associated_data=associated_data, verify_keys=verify_keys)


def encrypt_bytes(data: bytes, provider: KeyProvider, **kwargs: object) -> bytes:
    out = io.BytesIO()
    encrypt_stream(io.BytesIO(data), out, provider, length=len(data), **kwargs)  # type: ignore[arg-type]
    return out.getvalue()


def decrypt_bytes(blob: bytes, provider: KeyProvider, *, associated_data: bytes = b"",
                  verify_keys: Sequence[Ed25519PublicKey] = ()) -> bytes:
    out = io.BytesIO()
    decrypt_stream(io.BytesIO(blob), out, provider, associated_data=associated_data, verify_keys=verify_keys)
    return out.getvalue()


def encrypt_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], provider: KeyProvider, *,
                 audit: AuditRecorder | None = None, **kwargs: object) -> Header:
    """Encrypt a file into a container at ``dst`` (written atomically, mode 0600)."""
    with open(src, "rb") as fin, private_writer(dst) as fout:
        header = encrypt_stream(fin, fout, provider, **kwargs)  # type: ignore[arg-type]
    if audit is not None:
        audit.record("container.encrypt", Path(dst).name, details={
            "key_id": header.key_ids[0], "plaintext_bytes": header.plaintext_length,
            "segments": header.segment_count})
    return header


def decrypt_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], provider: KeyProvider,
                 *, associated_data: bytes = b"", audit: AuditRecorder | None = None,
                 verify_keys: Sequence[Ed25519PublicKey] = ()) -> Header:
    """Decrypt to ``dst`` atomically: on any integrity failure ``dst`` is not created/changed.

    The plaintext goes through :func:`~securetrain.crypto.private_file.private_writer`
    (``O_TMPFILE`` + ``linkat``): a decrypt killed at any point leaves no partial plaintext.
    """
    try:
        with open(src, "rb") as fin, private_writer(dst) as fout:
            header = decrypt_stream(fin, fout, provider, associated_data=associated_data, verify_keys=verify_keys)
    except IntegrityError as exc:
        if audit is not None:
            audit.record("container.decrypt", Path(src).name, outcome="failure",
                         details={"error": type(exc).__name__})
        raise
    if audit is not None:
        audit.record("container.decrypt", Path(src).name, details={
            "key_id": header.key_ids[0], "plaintext_bytes": header.plaintext_length})
    return header


def inspect_file(path: str | os.PathLike[str]) -> Header:
    """Parse the header without any key (nothing is authenticated!)."""
    with open(path, "rb") as fin:
        return read_header(fin)


def rewrap_file(path: str | os.PathLike[str], provider: KeyProvider, *, new_provider: KeyProvider | None = None,
                new_key_id: str | None = None, audit: AuditRecorder | None = None) -> tuple[Header, Header]:
    """Re-wrap a container's data key under ``new_provider``'s current (or ``new_key_id``) KEK.

    The stanza ``provider`` opened is replaced by the new one; stanzas of other recipients are
    kept (minus any duplicate of the new key id). The fixed header and every segment byte stay
    identical; only the stanzas and the header MAC change. The file is replaced atomically.
    Returns ``(old_header, new_header)``.
    """
    target = Path(path)
    dest = new_provider or provider
    with open(target, "rb") as fin:
        old = read_header(fin)
        data_key, opened = _unwrap(old, provider)
        keys = _derive(data_key, old.salt)
        kid = new_key_id or dest.current_key_id()
        stanza = _wrap_stanza(dest, kid, data_key)
        del data_key
        others = [s for i, s in enumerate(old.stanzas) if i != opened and s.key_id != kid]
        raw = _assemble(old.fixed, (stanza, *others), keys)
        size = os.fstat(fin.fileno()).st_size
        if size != old.total_length:
            raise (TruncatedError if size < old.total_length else TrailingDataError)(
                f"{target} is {size} bytes, header declares {old.total_length}; refusing to re-wrap")
        with private_writer(target) as fout:
            fout.write(raw)
            fout.flush()
            _copy_range(fin, fout, old.total_length - old.header_length)  # segments + signature trailer
    new = read_header(io.BytesIO(raw))
    if audit is not None:
        audit.record("key.rewrap", target.name, details={
            "old_key_ids": old.key_ids, "new_key_id": kid,
            "new_kek_fingerprint": new.stanzas[0].fingerprint.hex()})
    return old, new


def _copy_range(fin: BinaryIO, fout: BinaryIO, count: int) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    remaining = count
    while remaining:
        n = readinto_full(fin, view[: min(len(buf), remaining)])
        if not n:
            raise TruncatedError("file shrank while re-wrapping")
        fout.write(view[:n])
        remaining -= n

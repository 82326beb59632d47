"""Container byte format (v2, reads v1): constants, the parsed header, and header parsing.

The streaming AEAD container: AES-256-GCM segments under an HKDF-SHA256 file key.

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

import struct
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from securetrain.crypto._container.wrap_algs import WRAP_AES256_KW, WRAP_OPAQUE
from securetrain.crypto.errors import HeaderFormatError, TruncatedError
from securetrain.crypto.keys import FINGERPRINT_BYTES, KEY_ID_RE

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

def read_exact(src: BinaryIO, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes of the header part ``what``, else :class:`TruncatedError`."""
    buf = bytearray(n)
    got = readinto_full(src, memoryview(buf))
    if got != n:
        raise TruncatedError(f"input ends inside the {what} ({got} of {n} bytes)",
                             hint="the file was cut short (interrupted copy or write)")
    return bytes(buf)


class ByteSink(Protocol):
    """Where a :class:`EncryptingWriter` writes: a binary file, or a wrapper that hashes what passes through."""

    def write(self, data: bytes | memoryview, /) -> int: ...


class ByteSource(Protocol):
    """Anything :func:`readinto_full` reads from: a binary file, socket file, pipe or a :class:`DecryptingReader`."""

    def read(self, size: int = -1, /) -> bytes | None: ...


def readinto_full(src: ByteSource, view: memoryview) -> int:
    """Fill ``view`` from ``src``, tolerating short reads (pipes, sockets); return bytes read."""
    total = 0
    size = len(view)
    readinto = getattr(src, "readinto", None)
    while total < size:
        if readinto is not None:
            n = readinto(view[total:])
        else:
            chunk = src.read(size - total) or b""
            n = len(chunk)
            view[total:total + n] = chunk
        if not n:
            break
        total += n
    return total


def _read_fixed(src: BinaryIO) -> bytes:
    """The fixed header's 61 bytes. Empty input and input that does not start with the magic say so,
    rather than "cut short": a failed download piped in, or a plain file given by mistake."""
    buf = bytearray(FIXED.size)
    got = readinto_full(src, memoryview(buf))
    if got == 0:
        raise TruncatedError("input is empty (0 bytes): no container header",
                             hint="the source produced nothing (a failed download or copy upstream?)")
    n = min(got, len(MAGIC))
    if buf[:n] != MAGIC[:n]:
        raise HeaderFormatError("not a securetrain encrypted container (bad magic)",
                                hint="is this a plain safetensors/torch file or another format?")
    if got < FIXED.size:
        raise TruncatedError(f"input ends inside the fixed header ({got} of {FIXED.size} bytes)",
                             hint="the file was cut short (interrupted copy or write)")
    return bytes(buf)


def read_header(src: BinaryIO) -> Header:
    """Parse (not authenticate) a header; leaves ``src`` positioned at the first segment."""
    fixed = _read_fixed(src)
    magic, version, alg, seg, length, salt, prefix = FIXED.unpack(fixed)
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
        extra = read_exact(src, V2_EXTRA.size, "fixed header")
        flags, clen = V2_EXTRA.unpack(extra)
        if flags & ~KNOWN_FLAGS:
            raise HeaderFormatError(f"unknown header flags 0x{flags:02x}")
        if clen > MAX_CONTEXT_BYTES:
            raise HeaderFormatError(f"context of {clen} bytes exceeds {MAX_CONTEXT_BYTES}")
        context = read_exact(src, clen, "header context")
        fixed += extra + context
    (count,) = read_exact(src, 1, "stanza count")
    if not 1 <= count <= MAX_STANZAS:
        raise HeaderFormatError(f"invalid key stanza count {count}")
    parts = [fixed, bytes([count])]
    stanzas = []
    for _ in range(count):
        (kid_len,) = raw_len = read_exact(src, 1, "key stanza")
        if kid_len == 0:
            raise HeaderFormatError("empty key id in stanza")
        kid = read_exact(src, kid_len, "key stanza")
        rest = read_exact(src, 1 + FINGERPRINT_BYTES + 2, "key stanza")
        wrap_alg = rest[0]
        if wrap_alg not in (WRAP_AES256_KW, WRAP_OPAQUE):
            raise HeaderFormatError(f"unknown wrap_alg {wrap_alg} in key stanza")
        fp = rest[1:1 + FINGERPRINT_BYTES]
        (wlen,) = struct.unpack(">H", rest[-2:])
        if not 1 <= wlen <= MAX_WRAPPED_BYTES:
            raise HeaderFormatError(f"invalid wrapped key length {wlen}")
        wrapped = read_exact(src, wlen, "key stanza")
        try:
            key_id = kid.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderFormatError("key id is not UTF-8") from None
        if not KEY_ID_RE.fullmatch(key_id):  # ids get printed: no control characters or markup
            raise HeaderFormatError("key id contains characters outside [A-Za-z0-9._:/@-]")
        stanzas.append(Stanza(key_id, wrap_alg, fp, wrapped))
        parts += [raw_len, kid, rest, wrapped]
    commitment = read_exact(src, COMMIT_BYTES, "key commitment")
    mac = read_exact(src, MAC_BYTES, "header MAC")
    raw = b"".join(parts) + commitment + mac
    return Header(version, alg, seg, length, salt, prefix, tuple(stanzas), commitment, mac, fixed, raw,
                  flags, context)

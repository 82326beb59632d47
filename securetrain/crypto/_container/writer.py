"""The container writer: a write-only stream that encrypts a declared number of bytes segment by segment."""

from __future__ import annotations

import hashlib
import io
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import BinaryIO, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from securetrain.crypto._container.format import (
    ALG_AES256GCM_HKDF_SHA256,
    DEFAULT_SEGMENT_SIZE,
    FIXED,
    FLAG_SIGNED,
    MAGIC,
    MAX_CONTEXT_BYTES,
    MAX_SEGMENT_SIZE,
    MAX_SEGMENTS,
    MAX_STANZAS,
    MIN_SEGMENT_SIZE,
    PREFIX_BYTES,
    SALT_BYTES,
    TAG_BYTES,
    V2_EXTRA,
    VERSION,
    ByteSink,
    read_header,
    readinto_full,
    segment_count,
)
from securetrain.crypto._container.keyschedule import (
    assemble_header,
    derive_keys,
    segment_aad,
    segment_nonce,
    signed_message,
    signer_fingerprint,
    wrap_stanza,
)
from securetrain.crypto.errors import LimitExceededError, TruncatedError
from securetrain.crypto.keys import KeyProvider

_T = TypeVar("_T")


class EncryptingWriter:
    """Write-only stream that encrypts exactly ``length`` plaintext bytes into ``dst``.

    Memory: one segment of plaintext and one of ciphertext, preallocated. Writes of whole segments
    are encrypted straight from the caller's buffer (no copy). ``close()`` fails if fewer than
    ``length`` bytes were written; the output is then incomplete and must be discarded.
    """

    def __init__(
        self,
        dst: ByteSink,
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
        keys = derive_keys(data_key, salt)
        kid = key_id or provider.current_key_id()
        stanzas = [wrap_stanza(provider, kid, data_key)]
        # Extra recipients (e.g. a Vault break-glass key): the same data key, wrapped again.
        stanzas += [wrap_stanza(p, k or p.current_key_id(), data_key) for p, k in recipients]
        if len(stanzas) > MAX_STANZAS:
            raise LimitExceededError(f"at most {MAX_STANZAS} key stanzas per file")
        raw = assemble_header(fixed, tuple(stanzas), keys)
        self.header = read_header(io.BytesIO(raw))
        self.key_id = kid
        self._dst = dst
        self._aead = keys.payload
        self._aad = segment_aad(fixed, associated_data)
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

    def _guarded(self, fn: Callable[..., _T], *args: object) -> _T:
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
        nonce = segment_nonce(self._prefix, self._index, last)
        out = self._ctv[: len(plaintext) + TAG_BYTES]
        self._aead.encrypt_into(nonce, plaintext, self._aad, out)
        if self._sig_hash is not None:
            self._sig_hash.update(out)
        self._dst.write(out)
        self._index += 1

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._guarded(self._write, data)

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
        """Encrypt everything remaining in ``src`` (``readinto`` into the segment buffer, no copies).

        An in-memory source (:class:`io.BytesIO`) is encrypted straight from its buffer: the same
        cost as raw AES-GCM. ``src`` must hold exactly the bytes still declared, else the writer fails.
        """
        if isinstance(src, io.BytesIO):
            self._guarded(self._fill_from_buffer, src)
        else:
            self._guarded(self._fill_from, src)

    def _fill_from_buffer(self, src: io.BytesIO) -> None:
        pos = src.tell()
        size = self._length - self._written
        with src.getbuffer() as whole:
            available = len(whole) - pos
            if available < size:
                raise TruncatedError(f"source ended after {self._written + max(0, available)} of "
                                     f"{self._length} declared bytes")
            if available > size:
                raise LimitExceededError(f"source has more than the declared {self._length} bytes")
            with whole[pos:pos + size] as view:
                self._write(view)
        src.seek(pos + size)

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
            message = signed_message(self.header.fixed, self.header.commitment, self._sig_hash.digest())
            self._dst.write(signer_fingerprint(self._signer.public_key()) + self._signer.sign(message))
        self._closed = True

    def __enter__(self) -> EncryptingWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()

"""The container reader: a read-only stream that releases plaintext one authenticated segment at a time."""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, BinaryIO

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from securetrain.crypto._container.format import (
    SIGNER_FINGERPRINT_BYTES,
    TAG_BYTES,
    TRAILER_BYTES,
    read_exact,
    read_header,
    readinto_full,
)
from securetrain.crypto._container.keyschedule import (
    segment_aad,
    segment_nonce,
    signed_message,
    signer_fingerprint,
    unwrap_stanza,
)
from securetrain.crypto.errors import SegmentAuthError, SignatureError, TrailingDataError, TruncatedError
from securetrain.crypto.keys import KeyProvider
from securetrain.errors import IntegrityError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


class DecryptingReader(io.RawIOBase):
    """Read-only stream over an authenticated container.

    The constructor parses and authenticates the header (key, commitment, MAC) and, when ``src``
    is seekable, checks its size against the declared length - so truncation and trailing data
    fail before any plaintext. Plaintext is released one verified segment at a time.
    """

    def __init__(self, src: BinaryIO, provider: KeyProvider, *, associated_data: bytes = b"",
                 verify_keys: Sequence[Ed25519PublicKey] = ()) -> None:
        super().__init__()
        self.header = read_header(src)
        unwrapped = unwrap_stanza(self.header, provider)
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
        self._aead = unwrapped.keys.payload
        del unwrapped
        self._aad = segment_aad(h.fixed, associated_data)
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
        nonce = segment_nonce(self.header.nonce_prefix, i, last)
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
            trailer = read_exact(self._src, TRAILER_BYTES, "signature trailer")
            if self._sig_hash is not None:
                fp, sig = trailer[:SIGNER_FINGERPRINT_BYTES], trailer[SIGNER_FINGERPRINT_BYTES:]
                key = self._verify_keys.get(fp)
                if key is None:
                    raise SignatureError(f"container is signed by an unknown key (fingerprint {fp.hex()})",
                                         hint="add the writer's public key to the verify keys")
                try:
                    key.verify(sig, signed_message(h.fixed, h.commitment, self._sig_hash.digest()))
                except InvalidSignature:
                    raise SignatureError("container signature does not verify (content or header changed "
                                         "after signing, or a forged trailer)") from None
                self.signer = fp
        if self._src.read(1):
            raise TrailingDataError("data follows the final segment")

    # io.RawIOBase interface, so the plaintext can be consumed like a file.
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer, /) -> int:
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

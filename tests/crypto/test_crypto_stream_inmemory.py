"""encrypt_stream from an in-memory source encrypts from its buffer: same bytes out, same length checks."""

from __future__ import annotations

import io
import os

import pytest

from securetrain.crypto import _container as S
from securetrain.crypto.errors import LimitExceededError, TruncatedError
from securetrain.crypto.keys import LocalKeyring


class _Unbuffered(io.RawIOBase):
    """A non-BytesIO source (takes the fill_from path)."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        return self._src.readinto(b)


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 5000])
def test_in_memory_and_streamed_sources_decrypt_to_the_same_plaintext(size: int) -> None:
    ring = LocalKeyring.create("t")
    data = os.urandom(size)
    src = io.BytesIO(b"prefix" + data)
    src.seek(6)  # starts at the current position, like fill_from
    fast, slow = io.BytesIO(), io.BytesIO()
    S.encrypt_stream(src, fast, ring, segment_size=512)
    assert src.tell() == 6 + size
    S.encrypt_stream(_Unbuffered(data), slow, ring, length=size, segment_size=512)
    assert len(fast.getvalue()) == len(slow.getvalue())  # same layout (fresh keys/nonces differ)
    for blob in (fast, slow):
        out = io.BytesIO()
        blob.seek(0)
        S.decrypt_stream(blob, out, ring)
        assert out.getvalue() == data
    src.write(b"x")  # the source's buffer was released: it can grow again


def test_in_memory_source_length_checks() -> None:
    ring = LocalKeyring.create("t")
    with pytest.raises(TruncatedError):
        S.encrypt_stream(io.BytesIO(b"abc"), io.BytesIO(), ring, length=4)
    with pytest.raises(LimitExceededError):
        S.encrypt_stream(io.BytesIO(b"abcde"), io.BytesIO(), ring, length=4)

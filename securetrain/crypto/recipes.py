"""One-call recipes over the container primitives: seal a state dict into a file, open it again.

>>> from securetrain.crypto import LocalKeyring, seal_tensors, open_tensors
>>> ring = LocalKeyring.create()
>>> sealed = seal_tensors(model.state_dict(), "model.stenc", ring)
>>> opened = open_tensors("model.stenc", ring, expect_sha256=sealed.sha256)
>>> model.load_state_dict(opened.tensors)

The file is the container of ``docs/checkpoint-format.md`` (AES-256-GCM segments, per-file data
key wrapped under a KEK, safetensors inside, never pickle). ``seal_tensors`` writes atomically
with owner-only permissions (a killed writer leaves nothing); ``open_tensors`` authenticates every
segment before it returns anything. Failures raise :class:`~securetrain.crypto.errors.CryptoError`
subclasses: :class:`WrongKeyError`/:class:`KeyNotFoundError` (no key opens it),
:class:`SegmentAuthError`/:class:`TruncatedError`/:class:`HeaderAuthError` (edited or cut),
:class:`UnsafePayloadError` (not safetensors), :class:`DigestMismatchError` (not the file expected).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, BinaryIO

from securetrain.crypto.errors import DigestMismatchError
from securetrain.crypto.keys import KeyProvider
from securetrain.crypto.private_file import private_writer

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SealedFile:
    """What :func:`seal_tensors` wrote: keep ``sha256`` to pin the exact file when opening it."""

    path: Path
    sha256: str  # of the encrypted file, as written
    key_id: str  # the KEK that wraps its data key
    size: int
    tensor_count: int


@dataclass(frozen=True)
class OpenedTensors:
    """What :func:`open_tensors` read: the tensors (on ``device``) and the string metadata."""

    path: Path
    sha256: str
    key_id: str
    tensors: Mapping[str, torch.Tensor] = field(repr=False)
    metadata: Mapping[str, str] = field(default_factory=dict)


class _HashingWriter:
    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.hash = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes | memoryview) -> int:
        n = self._handle.write(data)
        self.hash.update(data)
        self.count += len(data)
        return n

    def flush(self) -> None:
        self._handle.flush()


def seal_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], keys: KeyProvider, *,
                 key_id: str | None = None, metadata: Mapping[str, str] | None = None) -> SealedFile:
    """Encrypt ``tensors`` (a state dict) and ``metadata`` into ``path`` under ``keys``' current KEK
    (or ``key_id``). The file appears complete or not at all; an existing file is replaced atomically."""
    from securetrain.crypto.checkpoint import write_checkpoint

    target = Path(path)
    with private_writer(target) as handle:
        sink = _HashingWriter(handle)
        written = write_checkpoint(sink, tensors, dict(metadata or {}), keys, key_id=key_id)
        sink.flush()
    return SealedFile(path=target, sha256=sink.hash.hexdigest(), key_id=written.key_id, size=sink.count,
                      tensor_count=len(tensors))


def open_tensors(path: str | os.PathLike[str], keys: KeyProvider, *, expect_sha256: str | None = None,
                 device: str = "cpu") -> OpenedTensors:
    """Authenticate and decrypt ``path``. ``expect_sha256`` (from :class:`SealedFile` or an audit
    entry) pins the exact file: another authentic file under the same key is refused."""
    from securetrain.crypto.checkpoint import read_checkpoint

    source = Path(path)
    with source.open("rb") as handle:
        digest = hashlib.sha256()
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
        sha256 = digest.hexdigest()
        if expect_sha256 is not None and sha256 != expect_sha256.lower():
            raise DigestMismatchError(f"{source.name}: SHA-256 {sha256[:16]}… is not the expected {expect_sha256[:16]}…",
                                      hint="the file was replaced or edited; restore the one that was sealed")
        handle.seek(0)
        loaded = read_checkpoint(handle, keys, device=device)
    return OpenedTensors(path=source, sha256=sha256, key_id=loaded.key_id, tensors=MappingProxyType(loaded.tensors),
                         metadata=MappingProxyType(dict(loaded.metadata)))

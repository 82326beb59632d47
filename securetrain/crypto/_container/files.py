"""Container convenience over the writer and reader: streams, bytes, files, header inspection, re-wrapping."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypedDict, Unpack

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from securetrain.audit.recorder import AuditRecorder
from securetrain.crypto._container.format import DEFAULT_SEGMENT_SIZE, ByteSink, Header, read_header, readinto_full
from securetrain.crypto._container.keyschedule import assemble_header, unwrap_stanza, wrap_stanza
from securetrain.crypto._container.reader import DecryptingReader
from securetrain.crypto._container.writer import EncryptingWriter
from securetrain.crypto.errors import LimitExceededError, TrailingDataError, TruncatedError
from securetrain.crypto.keys import KeyProvider
from securetrain.crypto.private_file import private_writer
from securetrain.errors import IntegrityError


class EncryptOptions(TypedDict, total=False):
    """Keyword options of :func:`encrypt_bytes` and :func:`encrypt_file` (see :func:`encrypt_stream`)."""

    segment_size: int
    associated_data: bytes
    key_id: str | None
    recipients: Sequence[tuple[KeyProvider, str | None]]
    context: bytes
    signer: Ed25519PrivateKey | None


@dataclass(frozen=True)
class RewrapResult:
    """What :func:`rewrap_file` did: the header before and after, and the key id now wrapping the data key."""

    path: Path
    old: Header
    new: Header
    key_id: str


def _stream_length(src: BinaryIO) -> int:
    try:
        here = src.tell()
        end = src.seek(0, os.SEEK_END)
        src.seek(here)
        return end - here
    except (OSError, AttributeError, ValueError):
        raise LimitExceededError("cannot determine the plaintext length of a non-seekable source",
                                 hint="pass length=<bytes>") from None


def encrypt_stream(src: BinaryIO, dst: ByteSink, provider: KeyProvider, *, length: int | None = None,
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
    writer.fill_from(src)  # an io.BytesIO is encrypted straight from its buffer
    writer.close()
    return writer.header


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


def encrypt_bytes(data: bytes, provider: KeyProvider, **kwargs: Unpack[EncryptOptions]) -> bytes:
    """Encrypt ``data`` into a container held in memory (options as :func:`encrypt_stream`)."""
    out = io.BytesIO()
    encrypt_stream(io.BytesIO(data), out, provider, length=len(data), **kwargs)
    return out.getvalue()


def decrypt_bytes(blob: bytes, provider: KeyProvider, *, associated_data: bytes = b"",
                  verify_keys: Sequence[Ed25519PublicKey] = ()) -> bytes:
    out = io.BytesIO()
    decrypt_stream(io.BytesIO(blob), out, provider, associated_data=associated_data, verify_keys=verify_keys)
    return out.getvalue()


def encrypt_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], provider: KeyProvider, *,
                 audit: AuditRecorder | None = None, **kwargs: Unpack[EncryptOptions]) -> Header:
    """Encrypt a file into a container at ``dst`` (written atomically, mode 0600)."""
    with open(src, "rb") as fin, private_writer(dst) as fout:
        header = encrypt_stream(fin, fout, provider, **kwargs)
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
                new_key_id: str | None = None, audit: AuditRecorder | None = None) -> RewrapResult:
    """Re-wrap a container's data key under ``new_provider``'s current (or ``new_key_id``) KEK.

    The stanza ``provider`` opened is replaced by the new one; stanzas of other recipients are
    kept (minus any duplicate of the new key id). The fixed header and every segment byte stay
    identical; only the stanzas and the header MAC change. The file is replaced atomically.
    Returns a :class:`RewrapResult` (the old and new header).
    """
    target = Path(path)
    dest = new_provider or provider
    with open(target, "rb") as fin:
        old = read_header(fin)
        unwrapped = unwrap_stanza(old, provider)
        kid = new_key_id or dest.current_key_id()
        stanza = wrap_stanza(dest, kid, unwrapped.data_key)
        others = [s for i, s in enumerate(old.stanzas) if i != unwrapped.stanza_index and s.key_id != kid]
        raw = assemble_header(old.fixed, (stanza, *others), unwrapped.keys)
        del unwrapped
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
    return RewrapResult(path=target, old=old, new=new, key_id=kid)


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
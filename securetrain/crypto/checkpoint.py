"""Encrypted checkpoints: a safetensors layout streamed into the AEAD container.

Nothing here ever unpickles. The safetensors layout (u64 header length, JSON header, raw tensor
bytes) is written tensor by tensor straight into :class:`EncryptingWriter`, so saving needs no
serialized copy of the state dict; loading parses and validates the header, allocates each tensor
and decrypts directly into it. Metadata (step, key id, tensor digest, caller metadata such as a
config hash) lives in the safetensors ``__metadata__`` and is therefore authenticated by the AEAD.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypedDict, Unpack

import torch

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.crypto._container import (
    ALIASES_KEY,
    DEFAULT_SEGMENT_SIZE,
    ByteSink,
    DecryptingReader,
    EncryptingWriter,
    Header,
    build_header,
    byte_view,
    cpu_contiguous,
    parse_header,
    prepare_tensors,
    readinto_full,
    refuse,
    restore_aliases,
    split_header,
)
from securetrain.crypto.errors import (
    BindingError,
    CryptoError,
    DigestMismatchError,
    KeyNotFoundError,
    UnsafePayloadError,
)
from securetrain.crypto.keys import KeyProvider
from securetrain.crypto.private_file import private_writer
from securetrain.errors import IntegrityError, SecureTrainError
from securetrain.training.checkpoint_store import CheckpointInfo, LoadedCheckpoint

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

FORMAT_TAG = "securetrain-checkpoint-v1"
META_FORMAT = "securetrain.format"
META_STEP = "securetrain.step"
META_KEY_ID = "securetrain.key_id"
META_DIGEST = "securetrain.tensors_sha256"
RESERVED_KEYS = frozenset({META_FORMAT, META_STEP, META_KEY_ID, META_DIGEST, ALIASES_KEY})

BINDING_TAG = "securetrain-checkpoint"
STORE_ID_FILE = ".store-id"
_STORE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class CheckpointError(CryptoError):
    """No checkpoint to load, or a store-level problem (not an integrity failure)."""


class NoVerifiedCheckpointError(CheckpointError, IntegrityError):
    """Checkpoints exist, but none of them verifies (each failure is in the audit log)."""


def binding_context(store_id: str, step: int) -> bytes:
    """The v2 header context of checkpoint ``step`` in store ``store_id`` (canonical JSON, public)."""
    return json.dumps({"securetrain": BINDING_TAG, "step": int(step), "store": store_id},
                      sort_keys=True, separators=(",", ":")).encode()


def check_binding(context: bytes, version: int, expected: bytes, *, name: str, accept_unbound: bool = False) -> None:
    """Refuse a container whose authenticated context is not ``expected`` (:class:`BindingError`)."""
    if context == expected:
        return
    if version < 2 and not context:
        if accept_unbound:
            return
        raise BindingError(f"{name} is a v1 container with no store/step binding; refused",
                           hint="checkpoints written before format v2: load with accept_unbound=True, then re-save")
    want = json.loads(expected)
    try:
        got = json.loads(context)
        what = []
        if got.get("store") != want["store"]:
            what.append(f"store {got.get('store')!r} instead of {want['store']!r}")
        if got.get("step") != want["step"]:
            what.append(f"step {got.get('step')!r} instead of {want['step']!r}")
        detail = ", ".join(what) or "a different binding"
    except (ValueError, AttributeError):
        detail = "a foreign context"
    raise BindingError(f"{name} is an authentic checkpoint of {detail}: substituted file refused",
                       hint="a checkpoint from another run or step was copied here; restore the original")


@dataclass(frozen=True)
class WrittenCheckpoint:
    """What :func:`write_checkpoint` wrote: the container header, the KEK id and the optional tensor digest."""

    header: Header
    key_id: str
    tensors_sha256: str | None  # the metadata's tensor digest (``digest=True``), else None


@dataclass(frozen=True)
class DecryptedCheckpoint:
    """What :func:`read_checkpoint` read, after every segment (and a signature, if required) verified."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    metadata: dict[str, str]
    header: Header
    signer: bytes | None  # fingerprint of the verified writer signature (``verify_keys``), else None

    @property
    def key_id(self) -> str:
        """The KEK id of the stanza that opened the file (the first one the header lists)."""
        return self.header.key_ids[0]


def write_checkpoint(dst: ByteSink, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                     provider: KeyProvider, *, key_id: str | None = None,
                     segment_size: int = DEFAULT_SEGMENT_SIZE, digest: bool = False,
                     on_progress: Callable[[int], None] | None = None,
                     recipients: Sequence[tuple[KeyProvider, str | None]] = (),
                     context: bytes = b"", signer: Ed25519PrivateKey | None = None,
                     ) -> WrittenCheckpoint:
    """Stream ``tensors`` + ``metadata`` as safetensors into an encrypted container on ``dst``."""
    prepared = prepare_tensors(tensors)  # refuses what cannot be written before a byte is
    kid = key_id or provider.current_key_id()
    tensors_sha = None
    if digest:  # a pre-pass: the digest goes in the header, which precedes the data
        h = hashlib.sha256()
        for _, t in prepared.items:
            h.update(byte_view(cpu_contiguous(t)))
        tensors_sha = h.hexdigest()
    meta = {str(k): str(v) for k, v in metadata.items()}
    meta[META_FORMAT] = FORMAT_TAG
    meta[META_KEY_ID] = kid
    if tensors_sha:
        meta[META_DIGEST] = tensors_sha
    hjson, offset = build_header(prepared, meta)
    total = 8 + len(hjson) + offset
    writer = EncryptingWriter(dst, provider, total, segment_size=segment_size, key_id=kid, recipients=recipients,
                              context=context, signer=signer)
    writer.write(struct.pack("<Q", len(hjson)) + hjson)
    for _, t in prepared.items:
        view = byte_view(cpu_contiguous(t))
        writer.write(view)
        if on_progress:
            on_progress(len(view))
    writer.close()
    return WrittenCheckpoint(header=writer.header, key_id=writer.key_id, tensors_sha256=tensors_sha)


def read_checkpoint(src: BinaryIO, provider: KeyProvider, *, verify_digest: bool = False,
                    device: str | torch.device = "cpu", expect_context: bytes | None = None,
                    accept_unbound: bool = False, verify_keys: Sequence[Ed25519PublicKey] = (),
                    name: str = "checkpoint",
                    ) -> DecryptedCheckpoint:
    """Authenticate, decrypt and parse a checkpoint container; refuses anything but safetensors.

    ``expect_context``: the header's authenticated binding must equal it (checked before any
    decryption; :class:`BindingError` otherwise). ``verify_keys``: a writer signature is required.
    """
    reader = DecryptingReader(src, provider, verify_keys=verify_keys)
    if expect_context is not None:
        check_binding(reader.header.context, reader.header.version, expect_context, name=name,
                      accept_unbound=accept_unbound)
    length = reader.header.plaintext_length
    first = bytearray(8)
    if readinto_full(reader, memoryview(first)) != 8:
        raise UnsafePayloadError("payload is too short to be a safetensors checkpoint")
    hlen = split_header(bytes(first), length)
    hbytes = bytearray(hlen)
    readinto_full(reader, memoryview(hbytes))
    if hbytes[:1] != b"{":
        raise refuse(bytes(first), "header is not a JSON object")
    entries, meta = parse_header(bytes(hbytes), length - 8 - hlen)
    tensors: dict[str, torch.Tensor] = {}
    h = hashlib.sha256() if verify_digest else None
    for name, dtype, shape, nbytes in entries:
        t = torch.empty(shape, dtype=dtype)
        if nbytes:
            view = byte_view(t)
            if readinto_full(reader, view) != nbytes:
                raise UnsafePayloadError("payload ended inside tensor data")
            if h is not None:
                h.update(view)
        tensors[name] = t if str(device) == "cpu" else t.to(device)
    if readinto_full(reader, memoryview(bytearray(1))) != 0 or not reader.finished:
        raise UnsafePayloadError("payload has bytes beyond the tensors its header lists")
    if h is not None and meta.get(META_DIGEST) and h.hexdigest() != meta[META_DIGEST]:
        raise DigestMismatchError("tensor digest does not match the checkpoint metadata")
    tensors, meta = restore_aliases(tensors, meta)  # tied weights: one tensor under each name
    return DecryptedCheckpoint(tensors=tensors, metadata=meta, header=reader.header, signer=reader.signer)


class _HashedSink:
    """File wrapper whose writes are flushed and handed to a :class:`BackgroundFileHasher`
    (the container's SHA-256 for the sidecar and the audit log, one pass, off the writer's thread)."""

    def __init__(self, handle: BinaryIO) -> None:
        from securetrain.crypto.private_file import BackgroundFileHasher

        self.handle = handle
        self.hasher = BackgroundFileHasher(handle.fileno())

    def write(self, data: bytes | memoryview) -> int:
        n = self.handle.write(data)
        self.handle.flush()  # in the file before the hasher reads it back
        self.hasher.advance(len(data))
        return n


_NAME = re.compile(r"^step-(\d{12})\.stenc$")


class StoreOptions(TypedDict, total=False):
    """Keyword options of :class:`EncryptedCheckpointStore` (for :meth:`~EncryptedCheckpointStore.from_env`)."""

    key_id: str | None
    keep_last: int | None
    audit: AuditRecorder | None
    segment_size: int
    digest: bool
    verify_sha256: bool | None
    recipients: Sequence[tuple[KeyProvider, str | None]]
    store_id: str | None
    signer: Ed25519PrivateKey | None
    verify_keys: Sequence[Ed25519PublicKey]
    accept_unbound: bool


class EncryptedCheckpointStore:
    """A :class:`~securetrain.training.checkpoint_store.CheckpointStore` of AEAD-encrypted safetensors.

    Files: ``<dir>/step-<12 digits>.stenc`` plus a small public sidecar ``.stenc.json``
    (step, sha256, key id, size, mtime, inode) so listing needs no full read; a stale or missing sidecar is
    recomputed. Every container binds ``(store_id, step)`` in its authenticated v2 header; loading
    refuses a checkpoint of another store/run or step (:class:`BindingError`, before decrypting),
    checks the authenticated step in the metadata too, and verifies the file's SHA-256 against the
    sidecar (or the caller's ``info``) in the same pass. ``store_id`` defaults to a random id kept
    in ``<dir>/.store-id``; pass the run's own id to also catch a whole directory swapped in.
    ``signer``/``verify_keys``: Ed25519 container signatures (writer authentication).
    """

    def __init__(self, directory: str | os.PathLike[str], keyring: KeyProvider, *, key_id: str | None = None,
                 keep_last: int | None = None, audit: AuditRecorder | None = None,
                 segment_size: int = DEFAULT_SEGMENT_SIZE, digest: bool = False,
                 verify_sha256: bool | None = None, recipients: Sequence[tuple[KeyProvider, str | None]] = (),
                 store_id: str | None = None, signer: Ed25519PrivateKey | None = None,
                 verify_keys: Sequence[Ed25519PublicKey] = (), accept_unbound: bool = False) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError("keep_last must be >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.keyring = keyring
        self.key_id = key_id
        self.keep_last = keep_last
        self.audit = audit or NullAuditRecorder()
        self.segment_size = segment_size
        self.digest = digest
        self.verify_sha256 = verify_sha256
        self.recipients = tuple(recipients)
        self.signer = signer
        self.verify_keys = tuple(verify_keys)
        self.accept_unbound = accept_unbound
        self.store_id = self._store_id(store_id)
        self.sweep()

    def _store_id(self, explicit: str | None) -> str:
        if explicit is not None:
            if not _STORE_ID.fullmatch(explicit):
                raise CheckpointError(f"invalid store id {explicit!r}", hint="1-128 of A-Z a-z 0-9 . _ : -")
            return explicit
        path = self.directory / STORE_ID_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except PermissionError:
            raise CheckpointError(f"cannot create {path} (read-only checkpoint directory?)",
                                  hint="pass store_id= explicitly to open a read-only store") from None
        except FileExistsError:
            # Another process (e.g. the other ranks of a torchrun job) may have just created it and
            # not yet written the id: wait briefly for the content rather than calling it malformed.
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    value = path.read_text(encoding="ascii", errors="replace").strip()
                except OSError as exc:
                    raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
                if value or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if not _STORE_ID.fullmatch(value):
                raise CheckpointError(f"{path} is malformed", hint="restore it, or pass store_id=") from None
            return value
        value = f"store-{secrets.token_hex(16)}"
        with os.fdopen(fd, "w") as handle:
            handle.write(value + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return value

    @classmethod
    def from_env(cls, directory: str | os.PathLike[str], *, keyring: str | os.PathLike[str] | None = None,
                 **kwargs: Unpack[StoreOptions]) -> EncryptedCheckpointStore:
        """A store whose KEK comes from ``keyring``/``SECURETRAIN_KEYRING`` or ``SECURETRAIN_KEK``."""
        from securetrain.crypto.keys import provider_from_env

        return cls(directory, provider_from_env(keyring), **kwargs)

    def __repr__(self) -> str:
        return f"EncryptedCheckpointStore({str(self.directory)!r}, key_id={self.key_id!r})"

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:012d}.stenc"

    def shard_store(self, rank: int) -> EncryptedCheckpointStore:
        """The store of rank ``rank``'s FSDP shards: same keys and settings, ``shards/rank-<R>/``,
        bound to ``<store id>.rank<R>`` (a shard moved to another rank's place is refused)."""
        return EncryptedCheckpointStore(
            self.directory / "shards" / f"rank-{int(rank):05d}", self.keyring, key_id=self.key_id,
            keep_last=None if self.keep_last is None else self.keep_last + 1,  # a crash between shard and manifest
            audit=self.audit, segment_size=self.segment_size, digest=self.digest, verify_sha256=self.verify_sha256,
            recipients=self.recipients, store_id=f"{self.store_id}.rank{int(rank)}"[:128], signer=self.signer,
            verify_keys=self.verify_keys, accept_unbound=self.accept_unbound)

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> CheckpointInfo:
        if not isinstance(step, int) or step < 0 or step >= 10**12:
            raise CheckpointError(f"invalid step {step!r}")
        path = self.path_for(step)
        # The store's own keys are always set by the store: metadata copied from a loaded checkpoint
        # must not carry a stale step or digest into the new one. Other keys (including the
        # trainer's "securetrain.train.*") pass through untouched.
        meta = {str(k): str(v) for k, v in metadata.items() if str(k) not in RESERVED_KEYS}
        meta[META_STEP] = str(step)
        try:
            with private_writer(path) as fout:
                sink = _HashedSink(fout)
                try:
                    written = write_checkpoint(
                        sink, tensors, meta, self.keyring, key_id=self.key_id,
                        segment_size=self.segment_size, digest=self.digest, recipients=self.recipients,
                        context=binding_context(self.store_id, step), signer=self.signer)
                except BaseException:
                    sink.hasher.cancel()
                    raise
                sink.hasher.close()  # the tail is hashed while private_writer fsyncs
                fout.flush()
                st = os.fstat(fout.fileno())  # identity of *our* file; the rename keeps inode and mtime
            sha256 = sink.hasher.hexdigest()
        except SecureTrainError as exc:
            self.audit.record("checkpoint.write", path.name, outcome="failure",
                              details={"step": step, "error": type(exc).__name__})
            raise
        info = CheckpointInfo(path=path, step=step, sha256=sha256, key_id=written.key_id)
        self._write_sidecar(info, st)
        self.audit.record("checkpoint.write", path.name, details={
            "step": step, "key_id": written.key_id, "sha256": info.sha256, "bytes": sink.hasher.count,
            "tensors": len(tensors), "tensors_sha256": written.tensors_sha256})
        self._prune()
        return info

    def load(self, info: CheckpointInfo | None = None) -> LoadedCheckpoint:
        """Load ``info`` (default: the latest).

        Refused with a typed error: another store's or step's checkpoint (:class:`BindingError`),
        a v1 container without binding (unless ``accept_unbound``), a SHA-256 differing from the
        sidecar / ``info`` (hashed in the same pass as decryption; ``verify_sha256=False`` skips
        it), a missing or bad signature when ``verify_keys`` are set, and any AEAD failure.
        """
        verify = self.verify_sha256 is not False
        if info is None:
            info = self.latest()
            if info is None:
                raise CheckpointError(f"no checkpoints in {self.directory}", hint="train first or check the path")
        try:
            with open(info.path, "rb") as raw:
                hasher = None
                if verify:  # hashes the same open file in a worker thread while this one decrypts
                    from securetrain.crypto.private_file import BackgroundFileHasher

                    hasher = BackgroundFileHasher(raw.fileno())
                    hasher.advance(os.fstat(raw.fileno()).st_size)
                    hasher.close()
                try:
                    loaded = read_checkpoint(
                        raw, self.keyring, expect_context=binding_context(self.store_id, info.step),
                        accept_unbound=self.accept_unbound, verify_keys=self.verify_keys, name=info.path.name)
                except BaseException:
                    if hasher is not None:
                        hasher.cancel()
                    raise
                digest = hasher.hexdigest() if hasher is not None else None
            if verify and digest != info.sha256:
                raise DigestMismatchError(f"{info.path.name}: sha256 differs from the recorded {info.sha256[:16]}...",
                                     hint="the file changed after its digest was recorded (sidecar or audit log)")
            if loaded.metadata.get(META_STEP) != str(info.step):
                raise BindingError(f"{info.path.name} holds step {loaded.metadata.get(META_STEP)!r}, not {info.step}",
                                     hint="checkpoint files were renamed or swapped")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file missing: {info.path}") from None
        except SecureTrainError as exc:
            self.audit.record("checkpoint.read", info.path.name, outcome="failure",
                              details={"step": info.step, "error": type(exc).__name__})
            raise
        key_id = loaded.key_id
        self.audit.record("checkpoint.read", info.path.name, details={
            "step": info.step, "key_id": key_id, "sha256": info.sha256, "tensors": len(loaded.tensors),
            "sha256_verified": verify, "bound": bool(loaded.header.context),
            "signer": loaded.signer.hex() if loaded.signer else None})
        return LoadedCheckpoint(info=CheckpointInfo(info.path, info.step, info.sha256, key_id), tensors=loaded.tensors,
                                metadata=loaded.metadata)

    def load_newest_verified(self, audit: AuditRecorder | None = None) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, falling back past damaged or substituted ones.

        Each skipped checkpoint is recorded (``checkpoint.skip``, outcome failure, with the error
        type and the step it fell back to) in ``audit`` (default: the store's recorder). ``None``
        for an empty store; :class:`NoVerifiedCheckpointError` when none verifies. A missing key
        (:class:`KeyNotFoundError`) is a configuration problem, not damage: it is raised at once.
        """
        recorder = audit or self.audit
        infos = self.list()
        if not infos:
            return None
        skipped: list[tuple[CheckpointInfo, str]] = []
        for info in reversed(infos):
            try:
                loaded = self.load(info)
            except KeyNotFoundError:
                raise
            except (IntegrityError, CheckpointError) as exc:
                skipped.append((info, type(exc).__name__))
                continue
            for bad, error in skipped:
                recorder.record("checkpoint.skip", bad.path.name, outcome="failure", details={
                    "step": bad.step, "error": error, "fallback_step": info.step})
            return loaded
        for bad, error in skipped:
            recorder.record("checkpoint.skip", bad.path.name, outcome="failure",
                            details={"step": bad.step, "error": error, "fallback_step": None})
        listing = ", ".join(f"step {i.step} ({err})" for i, err in skipped[:5])
        raise NoVerifiedCheckpointError(f"no checkpoint in {self.directory} verifies: {listing}",
                                        hint="restore checkpoints from a backup, or start a fresh run")

    def sweep(self) -> list[Path]:
        """Remove temps left by dead writers (``.step-*.tmp``; see ``private_file.sweep_stale_temps``)."""
        from securetrain.crypto.private_file import sweep_stale_temps

        removed = sweep_stale_temps(self.directory, prefix="step-")
        if removed:
            self.audit.record("checkpoint.sweep", self.directory.name,
                              details={"removed": len(removed), "names": [p.name for p in removed][:20]})
        return removed

    def list(self) -> list[CheckpointInfo]:
        infos = []
        for entry in sorted(self.directory.iterdir()):
            m = _NAME.match(entry.name)
            if m and entry.is_file():
                infos.append(self._info(entry, int(m.group(1))))
        return sorted(infos, key=lambda i: i.step)

    def latest(self) -> CheckpointInfo | None:
        steps = sorted(int(m.group(1)) for e in self.directory.iterdir() if (m := _NAME.match(e.name)))
        return self._info(self.path_for(steps[-1]), steps[-1]) if steps else None

    # -- sidecars -----------------------------------------------------------------------
    def _sidecar(self, path: Path) -> Path:
        return path.with_name(path.name + ".json")

    def _write_sidecar(self, info: CheckpointInfo, st: os.stat_result) -> None:
        doc = {"step": info.step, "sha256": info.sha256, "key_id": info.key_id, "bytes": st.st_size,
               "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        with private_writer(self._sidecar(info.path), durable=False) as out:  # recomputed if lost
            out.write(json.dumps(doc).encode())

    def _info(self, path: Path, step: int) -> CheckpointInfo:
        st = path.stat()
        try:
            doc = json.loads(self._sidecar(path).read_bytes())
            if (doc["bytes"], doc["mtime_ns"], doc["inode"], doc["step"]) == (
                    st.st_size, st.st_mtime_ns, st.st_ino, step):
                return CheckpointInfo(path, step, doc["sha256"], doc.get("key_id"))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        # Missing or stale (e.g. re-wrapped by key rotation): recompute from the file itself.
        from securetrain.crypto._container import inspect_file

        h = hashlib.sha256()
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())  # stat the file we hash, not whatever the name points to later
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        try:
            key_id: str | None = inspect_file(path).key_ids[0]
        except SecureTrainError:
            key_id = None
        info = CheckpointInfo(path, step, h.hexdigest(), key_id)
        try:
            self._write_sidecar(info, st)
        except OSError:
            pass
        return info

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        infos = self.list()
        for old in infos[: max(0, len(infos) - self.keep_last)]:
            for p in (old.path, self._sidecar(old.path)):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            self.audit.record("checkpoint.delete", old.path.name, details={"step": old.step, "sha256": old.sha256})

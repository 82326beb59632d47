"""KEK rotation that cannot destroy the only copy of a key, and the key escrow.

:func:`rotate_keyring` is what ``securetrain keys rotate`` runs. It refuses, before changing
anything, a ``--rewrap`` path that does not exist, a re-wrap set with no containers in it and
``remove_old`` without any re-wrap path. After re-wrapping it re-reads every container's header
under the given paths and never removes a key id that still wraps a data key there (a file whose
re-wrap failed, another recipient's stanza). Keys that are removed are first written to the
**escrow file** ``<keyring>.escrow`` (same format and passphrase as the keyring, mode 0600), so
an operator mistake stays recoverable until the keys are explicitly purged
(:func:`purge_escrow`, ``securetrain keys escrow purge``).

Everything that changes the keyring or the escrow runs under :func:`keyring_lock`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.crypto.errors import KeyringError
from securetrain.crypto.keys import LocalKeyring, SecretKey, keyring_lock
from securetrain.errors import SecureTrainError

ESCROW_SUFFIX = ".escrow"


class RotationRefusedError(KeyringError):
    """A rotation was refused before anything changed (missing path, nothing to re-wrap, ...)."""


class KeyStillInUseError(KeyringError):
    """A key asked to be removed still wraps the data key of a container under the re-wrap paths."""


class RewrapFailedError(KeyringError):
    """Some containers could not be re-wrapped; the previous keys were kept."""


def escrow_path(keyring: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(keyring)}{ESCROW_SUFFIX}")


def find_containers(paths: Iterable[Path]) -> list[Path]:
    """``*.stenc`` files under each directory, plus each listed file (sorted, de-duplicated)."""
    found: dict[Path, None] = {}
    for p in paths:
        if p.is_dir():
            for q in sorted(p.rglob("*.stenc")):
                if q.is_file() and not q.name.startswith("."):
                    found[q] = None
        elif p.is_file():
            found[p] = None
    return list(found)


def key_ids_in_use(files: Iterable[Path]) -> dict[str, list[Path]]:
    """Key id -> containers whose header has a stanza for it (unreadable headers are skipped)."""
    from securetrain.crypto._container import inspect_file

    used: dict[str, list[Path]] = {}
    for path in files:
        try:
            ids = inspect_file(path).key_ids
        except (SecureTrainError, OSError):
            continue
        for kid in ids:
            used.setdefault(kid, []).append(path)
    return used


@dataclass(frozen=True)
class RotationResult:
    """What :func:`rotate_keyring` did (returned when every re-wrap succeeded and nothing blocked removal)."""

    new_key: SecretKey
    previous_key_ids: tuple[str, ...]
    rewrapped: tuple[Path, ...] = ()
    failed: tuple[tuple[Path, str], ...] = ()  # (path, error type); always empty in a returned result
    removed: tuple[str, ...] = ()  # key ids removed from the keyring (kept in ``escrow``)
    escrow: Path | None = None


def rotate_keyring(
    keyring: str | os.PathLike[str],
    passphrase: str | None = None,
    *,
    rewrap: Sequence[str | os.PathLike[str]] = (),
    new_key_id: str | None = None,
    remove_old: bool = False,
    audit: AuditRecorder | None = None,
    on_file: Callable[[Path], None] | None = None,
) -> RotationResult:
    """Add a new current KEK, re-wrap the containers under ``rewrap`` and optionally retire the old keys.

    Raises :class:`RotationRefusedError` (nothing changed), :class:`RewrapFailedError` or
    :class:`KeyStillInUseError` (new key added and files re-wrapped, but no key removed).
    """
    audit = audit or NullAuditRecorder()
    ring_path = Path(keyring)
    paths = [Path(p) for p in rewrap]
    if remove_old and not paths:
        raise RotationRefusedError(
            "--remove-old without --rewrap would delete keys that may still wrap data keys",
            hint="pass --rewrap with every directory holding containers, or rotate without --remove-old")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise RotationRefusedError(f"re-wrap path(s) do not exist: {', '.join(missing)}",
                                   hint="check the spelling; nothing was changed")
    files = find_containers(paths)
    if paths and not files:
        raise RotationRefusedError(f"no containers (*.stenc) under {', '.join(map(str, paths))}",
                                   hint="nothing would be re-wrapped; nothing was changed")

    from securetrain.crypto._container import rewrap_file

    with keyring_lock(ring_path):
        ring = LocalKeyring.load(ring_path, passphrase)
        previous = ring.key_ids()
        key = ring.rotate(new_key_id)
        ring.save(ring_path, passphrase)  # the new key is durable before any file depends on it
        rewrapped: list[Path] = []
        failed: list[tuple[Path, str]] = []
        removed: list[str] = []
        escrow: Path | None = None
        for path in files:
            try:
                rewrap_file(path, ring, audit=audit)
                rewrapped.append(path)
            except (SecureTrainError, OSError) as exc:
                failed.append((path, type(exc).__name__))
            if on_file is not None:
                on_file(path)
        blocked: dict[str, list[Path]] = {}
        if remove_old:
            in_use = key_ids_in_use(files)
            blocked = {kid: in_use[kid] for kid in previous if kid in in_use}
            if not failed and not blocked and rewrapped:
                old_keys = [k for k in (ring.get(kid) for kid in previous) if k is not None]
                escrow = _escrow_keys(ring_path, passphrase, old_keys, audit)
                for kid in previous:
                    ring.remove(kid)
                ring.save(ring_path, passphrase)
                removed = list(previous)
        audit.record("key.rotate", f"keyring:{ring_path.name}", details={
            "new_key_id": key.key_id, "key_fingerprint": key.fingerprint, "previous_key_ids": previous,
            "rewrapped": len(rewrapped), "failed": len(failed), "removed_key_ids": removed,
            "escrowed": bool(removed)})
    if failed:
        names = ", ".join(f"{p.name} ({err})" for p, err in failed[:5])
        raise RewrapFailedError(
            f"{len(failed)} of {len(files)} container(s) were not re-wrapped: {names}; "
            f"new key {key.key_id} is current, previous keys kept",
            hint="fix or move those files, then rotate again (or re-wrap them with `securetrain keys rotate`)")
    if paths and not rewrapped:
        raise RotationRefusedError("nothing was re-wrapped; previous keys kept")
    if blocked:
        what = "; ".join(f"{kid} ({', '.join(p.name for p in ps[:3])})" for kid, ps in blocked.items())
        raise KeyStillInUseError(
            f"not removing keys that still wrap data keys under the re-wrap paths: {what}",
            hint="those stanzas belong to other recipients or failed re-wraps; previous keys kept")
    return RotationResult(new_key=key, previous_key_ids=tuple(previous), rewrapped=tuple(rewrapped),
                          failed=tuple(failed), removed=tuple(removed), escrow=escrow)


# -- escrow ------------------------------------------------------------------------------------


def _load_escrow(path: Path, passphrase: str | None) -> LocalKeyring:
    if not path.exists():
        return LocalKeyring(path=path)
    return LocalKeyring.load(path, passphrase)


def _escrow_keys(ring_path: Path, passphrase: str | None, keys: Sequence[SecretKey],
                 audit: AuditRecorder) -> Path:
    """Add ``keys`` to ``<keyring>.escrow`` and save it durably (caller holds the keyring lock)."""
    path = escrow_path(ring_path)
    escrow = _load_escrow(path, passphrase)
    for key in keys:
        try:
            escrow.put(key)
        except KeyringError:
            raise KeyringError(f"the escrow already holds a different key under id {key.key_id!r}",
                               hint=f"inspect {path} with `securetrain keys escrow list`; nothing was removed") from None
    escrow.save(path, passphrase)
    for key in keys:
        audit.record("key.escrow", f"keyring:{ring_path.name}",
                     details={"key_id": key.key_id, "key_fingerprint": key.fingerprint})
    return path


def escrow_list(keyring: str | os.PathLike[str], passphrase: str | None = None) -> list[SecretKey]:
    """Keys held in ``<keyring>.escrow`` (empty when there is no escrow file)."""
    return _load_escrow(escrow_path(keyring), passphrase).keys()


def purge_escrow(keyring: str | os.PathLike[str], passphrase: str | None = None, *,
                 key_ids: Sequence[str] = (), purge_all: bool = False,
                 audit: AuditRecorder | None = None) -> list[str]:
    """Destroy escrowed keys for good: the named ``key_ids`` or (``purge_all``) every one."""
    audit = audit or NullAuditRecorder()
    ring_path = Path(keyring)
    path = escrow_path(ring_path)
    if not key_ids and not purge_all:
        raise KeyringError("name the escrowed keys to purge (--key-id) or pass --all")
    with keyring_lock(ring_path):
        escrow = _load_escrow(path, passphrase)
        targets = escrow.key_ids() if purge_all else list(key_ids)
        unknown = [k for k in targets if escrow.get(k) is None]
        if unknown:
            raise KeyringError(f"not in the escrow: {', '.join(unknown)}", hint="see `securetrain keys escrow list`")
        purged = []
        for kid in targets:
            key = escrow.pop(kid)
            purged.append(kid)
            audit.record("key.purge", f"keyring:{ring_path.name}",
                         details={"key_id": kid, "key_fingerprint": key.fingerprint})
        if escrow.key_ids():
            escrow.save(path, passphrase)
        elif path.exists():
            path.unlink()
    return purged


def restore_from_escrow(keyring: str | os.PathLike[str], key_id: str, passphrase: str | None = None, *,
                        audit: AuditRecorder | None = None) -> SecretKey:
    """Put an escrowed key back into the keyring (not as current) and drop it from the escrow."""
    audit = audit or NullAuditRecorder()
    ring_path = Path(keyring)
    path = escrow_path(ring_path)
    with keyring_lock(ring_path):
        escrow = _load_escrow(path, passphrase)
        key = escrow.get(key_id)
        if key is None:
            raise KeyringError(f"key {key_id!r} is not in the escrow", hint="see `securetrain keys escrow list`")
        ring = LocalKeyring.load(ring_path, passphrase)
        ring.put(key)  # not current
        ring.save(ring_path, passphrase)  # durable in the keyring before it leaves the escrow
        escrow.pop(key_id)
        if escrow.key_ids():
            escrow.save(path, passphrase)
        else:
            path.unlink()
        audit.record("key.restore", f"keyring:{ring_path.name}",
                     details={"key_id": key_id, "key_fingerprint": key.fingerprint})
    return key

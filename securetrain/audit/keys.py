"""The log's Ed25519 signing key: a PEM file, owner-only.

Keys are created only on request (``securetrain audit keygen``, or a demo run's explicit
``secrets.create_demo_secrets``): a library call that needs a key and finds none fails closed.
A key created silently by a writer started in another directory would sign entries no auditor
holds the public key for, and a later run would blame "tampering" for the mismatch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from securetrain.audit.errors import AuditConfigError


def create_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Create a new key at ``path`` (mode 0600); refuses to replace an existing one."""
    file = Path(path)
    if file.exists() or file.is_symlink() or not _write_new_key(file):
        raise AuditConfigError(f"an audit signing key already exists at {file}",
                               hint="keep it (its public key is what auditors hold), or choose another path")
    return load_signing_key(file)


def load_or_create_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load the key at ``path``, creating it (mode 0600) if absent. For explicit set-up steps only
    (the demo's ``create_demo_secrets``, tests); library code paths call :func:`load_signing_key`."""
    file = Path(path)
    if not file.exists():
        _write_new_key(file)
    return load_signing_key(file)


def _write_new_key(file: Path) -> bool:
    """Write a fresh key to ``file`` unless one is there; False if another process won the race.

    Race-free across processes: the key is written to a temp file and hard-linked into place,
    which fails if the name exists; the loser then loads the winner's key.
    """
    file.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, file)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    file = Path(path)
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise AuditConfigError(
            f"audit signing key not found: {file}",
            hint=f"create it once with `securetrain audit keygen --out {file}` and give its public key to your "
            "auditors, or pass signing_key= / set SECURETRAIN_AUDIT_KEY to the existing key",
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuditConfigError(f"audit signing key {file} is readable by others", hint=f"chmod 600 {file}")
    try:
        key = serialization.load_pem_private_key(file.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise AuditConfigError(f"audit signing key {file} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AuditConfigError(f"audit signing key {file} is not an Ed25519 key")
    return key


def default_origin(key: Ed25519PublicKey) -> str:
    """A log's checkpoint origin (and note key name) when none is configured: tied to its public key."""
    return f"securetrain.local/audit/{hashlib.sha256(public_key_pem(key)).hexdigest()[:16]}"


def public_key_pem(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key_pem(data: bytes) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise AuditConfigError("public key is not a PEM SubjectPublicKeyInfo") from None
    if not isinstance(key, Ed25519PublicKey):
        raise AuditConfigError("public key is not Ed25519")
    return key

"""The log's Ed25519 signing key: a PEM file, owner-only, created once on first use."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from securetrain.audit.errors import AuditConfigError


def load_or_create_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load the key at ``path``, creating it (mode 0600) if absent.

    Creation is race-free across processes: the key is written to a temp file and hard-linked into
    place, which fails if another process won; then everyone loads the winner's key.
    """
    file = Path(path)
    if not file.exists():
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
            with contextlib.suppress(FileExistsError):
                os.link(tmp, file)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return load_signing_key(file)


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    file = Path(path)
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise AuditConfigError(f"audit signing key not found: {file}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuditConfigError(f"audit signing key {file} is readable by others", hint=f"chmod 600 {file}")
    try:
        key = serialization.load_pem_private_key(file.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise AuditConfigError(f"audit signing key {file} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AuditConfigError(f"audit signing key {file} is not an Ed25519 key")
    return key


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

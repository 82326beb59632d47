"""Who signs checkpoints: a local Ed25519 key, or HashiCorp Vault transit (the key never leaves Vault).

A signer is anything with ``sign(data) -> 64-byte Ed25519 signature`` and ``public_key()`` — the
two methods of ``Ed25519PrivateKey``, so a local key is a signer as it is. :class:`VaultTransitSigner`
signs through Vault's transit engine (``transit/sign/<name>``, an ``ed25519`` key), so writer hosts
hold a Vault token with ``update`` on that one path instead of a private key file. Every signature
Vault returns is verified locally against the key's public key before it is used (fail closed:
a rotated, replaced or wrong Vault key is caught at the first checkpoint, not by an auditor later).

Environment: ``SECURETRAIN_AUDIT_VAULT_KEY`` (transit key name; ``SECURETRAIN_AUDIT_VAULT_MOUNT``,
default ``transit``) selects Vault for any ``AuditLog`` opened without an explicit key; ``hvac``
reads ``VAULT_ADDR`` / ``VAULT_TOKEN`` itself.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any, Protocol, runtime_checkable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from securetrain.audit.errors import AuditConfigError, AuditSigningError

ENV_VAULT_KEY = "SECURETRAIN_AUDIT_VAULT_KEY"
ENV_VAULT_MOUNT = "SECURETRAIN_AUDIT_VAULT_MOUNT"


@runtime_checkable
class CheckpointSigner(Protocol):
    """Signs checkpoint notes with Ed25519 (``Ed25519PrivateKey`` is one)."""

    def sign(self, data: bytes) -> bytes: ...

    def public_key(self) -> Ed25519PublicKey: ...


class VaultTransitSigner:
    """Ed25519 signatures from Vault transit; the private key stays in Vault."""

    def __init__(self, key_name: str, *, client: Any = None, mount_point: str = "transit",
                 url: str | None = None, token: str | None = None) -> None:
        if client is None:
            from securetrain.crypto.vault import vault_client

            client = vault_client(url, token, error=AuditConfigError)
        self._client = client
        self.key_name = key_name
        self.mount_point = mount_point
        self._public: Ed25519PublicKey | None = None
        self._version: int | None = None

    def __repr__(self) -> str:
        return f"VaultTransitSigner(key={self.mount_point}/{self.key_name})"

    @classmethod
    def from_env(cls, environ: Any = None) -> VaultTransitSigner | None:
        env = os.environ if environ is None else environ
        name = env.get(ENV_VAULT_KEY)
        return cls(name, mount_point=env.get(ENV_VAULT_MOUNT) or "transit") if name else None

    def _read_key(self) -> None:
        try:
            data = self._client.secrets.transit.read_key(name=self.key_name, mount_point=self.mount_point)["data"]
        except Exception as exc:  # hvac raises its own types (Forbidden, InvalidPath, connection errors)
            raise AuditSigningError(f"cannot read Vault transit key {self.mount_point}/{self.key_name}: "
                                    f"{type(exc).__name__}", hint="check VAULT_ADDR, VAULT_TOKEN and the key name") from None
        if data.get("type") != "ed25519":
            raise AuditConfigError(f"Vault transit key {self.key_name} is {data.get('type')!r}, not ed25519",
                                   hint=f"vault write -f {self.mount_point}/keys/<name> type=ed25519")
        version = int(data["latest_version"])
        try:
            raw = base64.b64decode(data["keys"][str(version)]["public_key"], validate=True)
            self._public = Ed25519PublicKey.from_public_bytes(raw)
        except (KeyError, ValueError, binascii.Error):
            raise AuditSigningError(f"Vault returned no usable public key for {self.key_name}") from None
        self._version = version

    def public_key(self) -> Ed25519PublicKey:
        if self._public is None:
            self._read_key()
        assert self._public is not None
        return self._public

    def sign(self, data: bytes) -> bytes:
        public = self.public_key()
        try:
            response = self._client.secrets.transit.sign_data(
                name=self.key_name, hash_input=base64.b64encode(data).decode(), key_version=self._version,
                mount_point=self.mount_point)
            text = response["data"]["signature"]
        except Exception as exc:
            raise AuditSigningError(f"Vault transit refused to sign with {self.key_name}: {type(exc).__name__}",
                                    hint="the token needs update on transit/sign/<name>") from None
        prefix, _, encoded = str(text).rpartition(":")
        try:
            signature = base64.b64decode(encoded, validate=True)
            if not prefix.startswith("vault:v"):
                raise ValueError(prefix)
            public.verify(signature, data)
        except (ValueError, binascii.Error, InvalidSignature):
            raise AuditSigningError(
                f"Vault's signature does not verify with the public key of {self.key_name} (version {self._version})",
                hint="the transit key was rotated or replaced: pin the key version, or hand over to the new key",
            ) from None
        return signature

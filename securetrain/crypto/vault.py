"""HashiCorp Vault transit as a :class:`~securetrain.crypto.keys.KeyProvider` (extra ``[vault]``).

The KEK never leaves Vault: data keys are sent to ``transit/encrypt/<name>`` and the returned
``vault:vN:...`` ciphertext is stored as an opaque stanza. Key ids look like
``vault:<mount>/<name>``. Vault's own key versions handle rotation on the Vault side
(``transit/rewrap`` re-wraps without exposing the data key); this provider's :meth:`rewrap` uses it.
"""

from __future__ import annotations

import base64
from typing import Any

from securetrain.crypto._container import WRAP_OPAQUE
from securetrain.crypto.errors import KeyNotFoundError, KeyringError, WrongKeyError
from securetrain.errors import SecureTrainError


def vault_client(url: str | None = None, token: str | None = None, *,
                 error: type[SecureTrainError] = KeyringError) -> Any:
    """An ``hvac.Client`` (``VAULT_ADDR``/``VAULT_TOKEN`` when not given); ``error`` if hvac is missing."""
    try:
        import hvac
    except ImportError:
        raise error("Vault needs hvac", hint="pip install 'securetrain[vault]'") from None
    return hvac.Client(url=url, token=token)


class VaultTransitProvider:
    wrap_alg = WRAP_OPAQUE

    def __init__(self, key_name: str, *, client: Any = None, mount_point: str = "transit",
                 url: str | None = None, token: str | None = None) -> None:
        self._client = client if client is not None else vault_client(url, token)
        self.key_name = key_name
        self.mount_point = mount_point

    @property
    def key_id(self) -> str:
        return f"vault:{self.mount_point}/{self.key_name}"

    def current_key_id(self) -> str:
        return self.key_id

    def fingerprint_of(self, key_id: str) -> bytes | None:
        return None  # the KEK is inside Vault; nothing to fingerprint locally

    def _check(self, key_id: str) -> None:
        if key_id != self.key_id:
            raise KeyNotFoundError(f"key {key_id!r} is not served by this Vault provider ({self.key_id})")

    def wrap(self, key_id: str, data_key: bytes) -> bytes:
        self._check(key_id)
        try:
            resp = self._client.secrets.transit.encrypt_data(
                name=self.key_name, plaintext=base64.b64encode(data_key).decode(), mount_point=self.mount_point)
            return resp["data"]["ciphertext"].encode()
        except Exception as exc:  # hvac raises many types; never include the request body
            raise KeyringError(f"Vault transit encrypt with {self.key_id} failed: {type(exc).__name__}") from None

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes:
        self._check(key_id)
        try:
            resp = self._client.secrets.transit.decrypt_data(
                name=self.key_name, ciphertext=wrapped.decode("ascii"), mount_point=self.mount_point)
            data_key = base64.b64decode(resp["data"]["plaintext"])
        except Exception as exc:
            raise WrongKeyError(f"Vault transit could not unwrap the data key with {self.key_id}: "
                                f"{type(exc).__name__}") from None
        return data_key

    def rewrap(self, key_id: str, wrapped: bytes) -> bytes:
        """Re-wrap under the latest Vault key version without the data key leaving Vault."""
        self._check(key_id)
        resp = self._client.secrets.transit.rewrap_data(
            name=self.key_name, ciphertext=wrapped.decode("ascii"), mount_point=self.mount_point)
        return resp["data"]["ciphertext"].encode()

    def __repr__(self) -> str:
        return f"VaultTransitProvider(key_id={self.key_id!r})"

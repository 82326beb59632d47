"""The data owner's secret CKKS context at rest: sealed in the project's AEAD container.

The secret context (``DataOwner.secret_context()``) holds the CKKS secret key, so on disk it is
wrapped in the streaming AES-256-GCM container (:func:`securetrain.crypto.encrypt_bytes`) under a KEK
from :func:`securetrain.crypto.keys.provider_from_env` (keyring, Vault transit or
``SECURETRAIN_KEK``). :data:`SECRET_CONTEXT_AD` is bound into every segment, so another
container sealed under the same KEK (a checkpoint, say) cannot be swapped in: it fails
authentication instead of being parsed as a context.

Readers tell the two on-disk forms apart by magic: ``\\x89STENC\\r\\n`` (sealed) or ``STHE...``
(the plain he-context container written by ``--insecure-plaintext-secret`` or older versions,
accepted with a warning).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Union

from securetrain.he import container
from securetrain.he.errors import HEFormatError, HEKeySourceError

if TYPE_CHECKING:
    from securetrain.crypto.keys import KeyProvider

log = logging.getLogger(__name__)

SECRET_CONTEXT_AD = b"securetrain he secret context v1"
SEALED_MAGIC = b"\x89STENC\r\n"  # the container magic (tests check it against securetrain.crypto._container.MAGIC)

KEY_SOURCE_HINT = ("pass --keyring FILE (passphrase in SECURETRAIN_KEYRING_PASSPHRASE), or set SECURETRAIN_KEYRING, "
                   "SECURETRAIN_VAULT_TRANSIT_KEY or SECURETRAIN_KEK (see docs/keys.md)")

ProviderSource = Union["KeyProvider", Callable[[], "KeyProvider"]]


def key_source_configured(keyring: str | os.PathLike[str] | None = None) -> bool:
    """Whether :func:`provider_from_env` has anything to work with (without opening it)."""
    from securetrain.crypto.keys import ENV_KEK, ENV_KEYRING, ENV_VAULT_KEY

    return keyring is not None or any(os.environ.get(v) for v in (ENV_KEYRING, ENV_VAULT_KEY, ENV_KEK))


def provider_for_secret(keyring: str | os.PathLike[str] | None = None, *, purpose: str = "protect") -> KeyProvider:
    """The configured KEK provider; :class:`HEKeySourceError` (a ConfigError) when none is set.

    Other key problems (wrong passphrase, keyring mode, malformed KEK) surface as the crypto
    capability's own ``KeyringError``.
    """
    from securetrain.crypto.keys import provider_from_env

    if not key_source_configured(keyring):
        raise HEKeySourceError(f"no key-encryption key is configured to {purpose} the CKKS secret context",
                               hint=KEY_SOURCE_HINT)
    return provider_from_env(keyring)


def is_sealed(data: bytes) -> bool:
    return data[: len(SEALED_MAGIC)] == SEALED_MAGIC


def seal_secret_context(secret_context: bytes, provider: KeyProvider, *, key_id: str | None = None) -> bytes:
    """Encrypt ``secret_context`` bytes into an AEAD container bound to :data:`SECRET_CONTEXT_AD`."""
    from securetrain.crypto import encrypt_bytes

    c = container.decode(secret_context, expect_kind="he-context", source="secret context")
    if not c.header.get("has_secret_key"):
        raise HEFormatError("refusing to seal a public context as the secret context")
    return encrypt_bytes(secret_context, provider, associated_data=SECRET_CONTEXT_AD, key_id=key_id)


def open_secret_context(data: bytes, provider: ProviderSource | None, *, source: str = "secret context",
                        warn: Callable[[str], None] | None = None) -> tuple[bytes, bool]:
    """Return ``(he-context bytes, was_sealed)``.

    ``provider`` may be a callable, resolved only when ``data`` is sealed (a plaintext file
    needs no key). A plaintext context is returned after calling ``warn`` (default: log a
    warning). Integrity failures keep their crypto type (``WrongKeyError``, ``KeyNotFoundError``,
    ``SegmentAuthError``, ``HeaderAuthError``, ``TruncatedError``… all ``IntegrityError``), with
    ``source`` in the message.
    """
    from securetrain.crypto import decrypt_bytes
    from securetrain.errors import IntegrityError

    if not is_sealed(data):
        if data[: len(container.MAGIC)] != container.MAGIC:
            raise HEFormatError(f"{source} is neither a sealed nor a plain securetrain secret context (bad magic)",
                                hint="pass the secret.stctx written by `securetrain he keygen`")
        msg = (f"{source} is an UNENCRYPTED secret context: anyone who can read it can decrypt your data; "
               "re-run `securetrain he keygen` with a key source, or `securetrain he seal-secret`")
        (warn or log.warning)(msg)
        return data, False
    if provider is None:
        raise HEKeySourceError(f"{source} is encrypted and no key provider was given", hint=KEY_SOURCE_HINT)
    prov = provider if hasattr(provider, "unwrap") else provider()  # type: ignore[operator]
    try:
        plain = decrypt_bytes(data, prov, associated_data=SECRET_CONTEXT_AD)  # type: ignore[arg-type]
    except IntegrityError as exc:
        hint = exc.hint or ("the file was modified or truncated, or it is not a sealed secret context "
                            "(e.g. a checkpoint container)")
        raise type(exc)(f"{source}: {exc.args[0] if exc.args else type(exc).__name__}", hint=hint) from exc
    if plain[: len(container.MAGIC)] != container.MAGIC:
        raise HEFormatError(f"{source} decrypted, but does not hold an he-context")
    return plain, True


def write_secret_context(path: str | os.PathLike[str], secret_context: bytes, provider: KeyProvider | None) -> int:
    """Write atomically with mode 0600: sealed under ``provider``, or plaintext when it is ``None``
    (callers only pass ``None`` for an explicit insecure opt-in). Returns the bytes written."""
    from securetrain.io.atomic import atomic_write_bytes

    blob = secret_context if provider is None else seal_secret_context(secret_context, provider)
    atomic_write_bytes(Path(path), blob, mode=0o600)
    return len(blob)

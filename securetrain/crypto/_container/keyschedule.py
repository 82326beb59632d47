"""Container key schedule: HKDF file keys, segment nonces and AAD, key stanzas, header MAC, signatures.

``docs/checkpoint-format.md`` sections 3-5 specify every derivation here; keep the two in sync.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from securetrain.crypto._container.format import (
    MAC_BYTES,
    MAX_WRAPPED_BYTES,
    SIGNER_FINGERPRINT_BYTES,
    Header,
    Stanza,
)
from securetrain.crypto._container.wrap_algs import WRAP_AES256_KW, WRAP_OPAQUE
from securetrain.crypto.errors import HeaderAuthError, KeyNotFoundError, LimitExceededError, WrongKeyError
from securetrain.crypto.keys import FINGERPRINT_BYTES, KeyProvider

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

_LABEL = b"securetrain-stream-v1 "
_SIG_LABEL = b"securetrain-container-signature-v2\x00"
_SEG_NONCE = struct.Struct(">IB")


@dataclass(frozen=True, repr=False)  # holds key material: no field-printing repr
class FileKeys:
    """The per-file keys HKDF derives from the data key and the header salt."""

    payload: AESGCM
    mac_key: bytes
    commitment: bytes


@dataclass(frozen=True, repr=False)  # holds key material: no field-printing repr
class UnwrappedKey:
    """A data key a provider unwrapped and the header authenticated: which stanza, and its file keys."""

    data_key: bytes
    stanza_index: int
    keys: FileKeys


def _hkdf(data_key: bytes, salt: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=_LABEL + label).derive(data_key)


def derive_keys(data_key: bytes, salt: bytes) -> FileKeys:
    """The payload key, header-MAC key and key commitment of a file (format section 3)."""
    return FileKeys(AESGCM(_hkdf(data_key, salt, b"payload")), _hkdf(data_key, salt, b"header-mac"),
                    _hkdf(data_key, salt, b"commitment"))


def segment_aad(fixed: bytes, associated_data: bytes) -> bytes:
    """The AAD of every segment: SHA-256 of the fixed header and the caller's associated data."""
    return hashlib.sha256(fixed + struct.pack(">Q", len(associated_data)) + associated_data).digest()


def segment_nonce(prefix: bytes, index: int, last: bool) -> bytes:
    """Tink's nonce layout: the 7-byte prefix, a u32 segment counter, a u8 last-segment flag."""
    return prefix + _SEG_NONCE.pack(index, 1 if last else 0)


def signer_fingerprint(public_key: Ed25519PublicKey) -> bytes:
    """8-byte public identifier of a container-signing key (stored in the signature trailer)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(b"securetrain signer fingerprint v1\x00" + raw).digest()[:SIGNER_FINGERPRINT_BYTES]


def signed_message(fixed: bytes, commitment: bytes, segments_sha256: bytes) -> bytes:
    """What the Ed25519 trailer signs: label | fixed header | commitment | SHA-256 of the segments."""
    return _SIG_LABEL + fixed + commitment + segments_sha256


def wrap_stanza(provider: KeyProvider, key_id: str, data_key: bytes) -> Stanza:
    """Wrap ``data_key`` under ``provider``'s KEK ``key_id`` as a header stanza."""
    wrapped = provider.wrap(key_id, data_key)
    if len(wrapped) > MAX_WRAPPED_BYTES:
        raise LimitExceededError(f"wrapped data key from {key_id!r} is {len(wrapped)} bytes (max {MAX_WRAPPED_BYTES})")
    fp_fn = getattr(provider, "fingerprint_of", None)
    fp = (fp_fn(key_id) if fp_fn else None) or bytes(FINGERPRINT_BYTES)
    wrap_alg = int(getattr(provider, "wrap_alg", WRAP_OPAQUE))
    if wrap_alg not in (WRAP_AES256_KW, WRAP_OPAQUE):
        raise LimitExceededError(f"provider declares unknown wrap_alg {wrap_alg}")
    return Stanza(key_id, wrap_alg, fp, wrapped)


def assemble_header(fixed: bytes, stanzas: tuple[Stanza, ...], keys: FileKeys) -> bytes:
    """The header bytes: fixed header, stanzas, key commitment and the header MAC over all of them."""
    body = fixed + struct.pack(">B", len(stanzas)) + b"".join(s.encode() for s in stanzas) + keys.commitment
    return body + hmac.new(keys.mac_key, body, hashlib.sha256).digest()


def unwrap_data_key(header: Header, provider: KeyProvider) -> bytes:
    """Find a stanza ``provider`` can open, unwrap it, check the key commitment and the header MAC."""
    return unwrap_stanza(header, provider).data_key


def unwrap_stanza(header: Header, provider: KeyProvider) -> UnwrappedKey:
    """As :func:`unwrap_data_key`, also naming the stanza that opened and the derived file keys."""
    data_key: bytes | None = None
    failure: Exception | None = None
    opened = -1
    for index, stanza in enumerate(header.stanzas):
        try:
            candidate = provider.unwrap(stanza.key_id, stanza.wrapped)
        except KeyNotFoundError as exc:
            failure = failure or exc
            continue
        except WrongKeyError as exc:
            failure = exc
            continue
        if len(candidate) != 32:
            failure = WrongKeyError(f"key {stanza.key_id!r} unwrapped to a {len(candidate)}-byte key")
            continue
        data_key, opened = candidate, index
        break
    if data_key is None:
        if isinstance(failure, WrongKeyError) and not isinstance(failure, KeyNotFoundError):
            raise failure
        raise KeyNotFoundError(
            f"none of the file's keys ({', '.join(header.key_ids)}) is available",
            hint="load the keyring that wrote it; rotated files name the new key id")
    keys = derive_keys(data_key, header.salt)
    # Key commitment first: a wrong (or substituted) data key fails here, before any decryption.
    if not hmac.compare_digest(keys.commitment, header.commitment):
        raise WrongKeyError("the data key does not match the file's key commitment",
                            hint="wrong key, or the header salt/commitment was modified")
    body = header.raw[:-MAC_BYTES]
    if not hmac.compare_digest(hmac.new(keys.mac_key, body, hashlib.sha256).digest(), header.mac):
        raise HeaderAuthError("container header failed authentication (it was modified)")
    return UnwrappedKey(data_key, opened, keys)

"""Typed errors of the crypto capability.

Every error here derives from :class:`CryptoError`; every integrity failure also from
:class:`securetrain.errors.IntegrityError`, so callers can fail closed on one type; the subclasses
say *what* failed. Messages carry key ids, fingerprints, segment
numbers and sizes only - never key bytes or plaintext.
"""

from __future__ import annotations

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError


class CryptoError(SecureTrainError):
    """Base of every error the crypto capability raises on purpose (catch this for "any crypto failure")."""


class HeaderAuthError(CryptoError, IntegrityError):
    """The container header was edited (its MAC does not verify) or cannot be authenticated."""


class HeaderFormatError(HeaderAuthError):
    """The header is malformed: bad magic, unsupported version/algorithm, impossible field values."""


class SegmentAuthError(CryptoError, IntegrityError):
    """A payload segment failed AES-GCM authentication (edited, reordered, duplicated or cut)."""


class TruncatedError(CryptoError, IntegrityError):
    """The input ended before the final segment (or before the end of the header)."""


class TrailingDataError(CryptoError, IntegrityError):
    """Bytes follow the final segment."""


class WrongKeyError(CryptoError, IntegrityError):
    """The available key cannot open this file (unwrap failed or key commitment mismatch)."""


class KeyNotFoundError(WrongKeyError):
    """None of the file's key ids is available from the key provider."""


class UnsafePayloadError(CryptoError, IntegrityError):
    """The decrypted payload is not a valid safetensors layout (e.g. a pickle) and is refused."""


class ReplayError(CryptoError, IntegrityError):
    """A transport message was replayed, reordered, expired or addressed to someone else."""


class LimitExceededError(CryptoError):
    """An input exceeds a cryptographic limit (NIST SP 800-38D, segment counter, size caps)."""


class KeyringError(CryptoError, ConfigError):
    """The keyring file or key configuration is missing, unsafe or cannot be opened."""


class KeyringPermissionError(KeyringError):
    """The keyring file is readable by group/others; refused."""


class SignatureError(CryptoError, IntegrityError):
    """A required container signature is missing, from an unknown signer, or does not verify."""


class BindingError(CryptoError, IntegrityError):
    """An authentic container that belongs elsewhere: another store/run or another step (substitution)."""


class DigestMismatchError(CryptoError, IntegrityError):
    """A file's SHA-256 differs from the digest recorded for it (sidecar, audit log, metadata)."""


class MessageAuthError(CryptoError, IntegrityError):
    """A transport message failed authentication (modified, wrong key, or not from the claimed sender)."""


class UnsupportedTensorError(CryptoError):
    """A tensor (or state-dict entry) the sealed safetensors payload cannot hold faithfully.

    Raised before anything is written (no file, no message): an unsupported dtype, layout, device
    or tensor subclass, a key that is not a unique non-empty string, a value that is not a tensor,
    or metadata that is not ``str -> str``. The message names the key and the dtype; the hint says
    how to convert the entry into something that round-trips.
    """

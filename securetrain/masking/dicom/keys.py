"""One project secret -> independent keyed functions for UIDs, dates and pseudonyms.

HKDF-SHA256 derives a sub-key per purpose, so learning one derived value tells nothing about
the others and the secret itself never touches DICOM data. Every function is an HMAC (not a
bare hash): without the secret nobody can confirm a guess like "is this the UID of study X".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from securetrain.masking.dicom.errors import DeidKeyError

MIN_SECRET_BYTES = 16
ENV_KEY = "SECURETRAIN_DEID_KEY"
_SALT = b"securetrain.dicom.deid.v1"


def _derive(secret: bytes, purpose: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=purpose.encode()).derive(secret)


@dataclass(frozen=True)
class DeidKeys:
    """Derived sub-keys. Build with :meth:`from_secret`; ``repr`` never shows key bytes."""

    uid_key: bytes = field(repr=False)
    date_key: bytes = field(repr=False)
    pseudonym_key: bytes = field(repr=False)
    key_id: str  # public fingerprint, safe for audit logs and reports

    @classmethod
    def from_secret(cls, secret: bytes) -> DeidKeys:
        if not isinstance(secret, bytes | bytearray):
            raise DeidKeyError("the de-identification secret must be bytes", hint="pass the raw key bytes")
        if len(secret) < MIN_SECRET_BYTES:
            raise DeidKeyError(
                f"the de-identification secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required",
                hint="generate one with: python -c 'import secrets; print(secrets.token_hex(32))'",
            )
        secret = bytes(secret)
        return cls(
            uid_key=_derive(secret, "uid"),
            date_key=_derive(secret, "date-offset"),
            pseudonym_key=_derive(secret, "pseudonym"),
            key_id=hashlib.sha256(_derive(secret, "key-id")).hexdigest()[:16],
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DeidKeys:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_KEY)
        if not raw:
            raise DeidKeyError(f"no de-identification key: set {ENV_KEY} (64 hex characters) or pass --key-file")
        return cls.from_secret(parse_key_text(raw.encode(), what=ENV_KEY, hex_only=True))


def parse_key_text(data: bytes, *, what: str = "key", hex_only: bool = False) -> bytes:
    """Key material in one explicit encoding (see :mod:`securetrain.keytext`): 64 hex characters,
    ``hex:...``, ``base64:...`` or, for files (not ``hex_only``), exactly 32 raw non-text bytes.

    Anything else is an error: a typo must not silently become a different key."""
    from securetrain.keytext import decode_key

    return decode_key(data, what=what, error=DeidKeyError, min_bytes=MIN_SECRET_BYTES, allow_raw=not hex_only)


class KeyedMapper:
    """Deterministic keyed remaps. Memoised: a study repeats the same UIDs thousands of times."""

    def __init__(self, keys: DeidKeys, *, max_shift_days: int = 3650) -> None:
        self._keys = keys
        self.max_shift_days = max_shift_days
        self.uid = lru_cache(maxsize=65536)(self._uid)
        self.pseudonym = lru_cache(maxsize=16384)(self._pseudonym)
        self.day_offset = lru_cache(maxsize=16384)(self._day_offset)

    def _uid(self, original: str) -> str:
        digest = hmac.new(self._keys.uid_key, original.encode("ascii", "replace"), hashlib.sha256).digest()
        # 2.25.<128-bit integer> is the UUID-derived UID root (PS3.5 B.2): valid and unique.
        return "2.25." + str(int.from_bytes(digest[:16], "big"))

    def _pseudonym(self, patient_identity: str) -> str:
        digest = hmac.new(self._keys.pseudonym_key, patient_identity.encode("utf-8"), hashlib.sha256).digest()
        return "ST" + base64.b32encode(digest[:10]).decode("ascii")  # 18 chars, fits LO and PN components

    def _day_offset(self, pseudonym: str) -> int:
        """Whole days in [-max, +max] without 0, from the *pseudonym* (never the real id)."""
        digest = hmac.new(self._keys.date_key, pseudonym.encode("ascii"), hashlib.sha256).digest()
        n = int.from_bytes(digest[:8], "big")
        magnitude = 1 + n % self.max_shift_days
        return magnitude if (n >> 63) & 1 else -magnitude

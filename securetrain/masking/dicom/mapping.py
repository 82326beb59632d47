"""The re-identification mapping (original patient id -> pseudonym), stored only encrypted.

File format (version 1), all of it authenticated:

    magic   8 bytes  b"STDMAP1\\n"
    nonce  12 bytes  random
    body    rest     AES-256-GCM(key, nonce, plaintext, aad=magic) incl. 16-byte tag

``plaintext`` is UTF-8 JSON ``{"version": 1, "entries": {"<original>": "<pseudonym>", ...}}``
(keys sorted), plus, when ``securetrain deid`` wrote it, ``"files": {"<input path relative to IN>":
"<output path relative to OUT>", ...}`` -- the only place the input file names are kept. The key is 32 caller-supplied bytes; the file is written atomically with mode
0600 and never exists in plaintext, not even as a temporary file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.dicom.errors import DeidKeyError, MappingIntegrityError

MAGIC = b"STDMAP1\n"
_NONCE = 12


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != 32:
        raise DeidKeyError("the mapping key must be exactly 32 bytes (AES-256)", hint="use secrets.token_bytes(32)")


def encrypt_mapping(entries: Mapping[str, str], key: bytes, files: Mapping[str, str] | None = None) -> bytes:
    _check_key(key)
    body: dict[str, object] = {"version": 1, "entries": dict(sorted(entries.items()))}
    if files is not None:
        body["files"] = dict(sorted(files.items()))
    plaintext = json.dumps(body, ensure_ascii=False).encode()
    nonce = os.urandom(_NONCE)
    return MAGIC + nonce + AESGCM(bytes(key)).encrypt(nonce, plaintext, MAGIC)


def decrypt_mapping(blob: bytes, key: bytes) -> dict[str, str]:
    return dict(_decrypt(blob, key)["entries"])


def _decrypt(blob: bytes, key: bytes) -> dict:
    _check_key(key)
    if len(blob) < len(MAGIC) + _NONCE + 16 or not blob.startswith(MAGIC):
        raise MappingIntegrityError("not a securetrain pseudonym mapping file, or truncated")
    nonce = blob[len(MAGIC) : len(MAGIC) + _NONCE]
    try:
        plaintext = AESGCM(bytes(key)).decrypt(nonce, blob[len(MAGIC) + _NONCE :], MAGIC)
    except InvalidTag:
        raise MappingIntegrityError(
            "pseudonym mapping failed authentication", hint="wrong key, or the file was modified or truncated"
        ) from None
    return json.loads(plaintext)


def export_mapping(path: str | os.PathLike[str], entries: Mapping[str, str], key: bytes,
                   files: Mapping[str, str] | None = None) -> Path:
    """Encrypt ``entries`` (and the input -> output ``files`` map) and atomically write them to ``path`` (mode 0600)."""
    atomic_write_bytes(path, encrypt_mapping(entries, key, files))
    return Path(path)


def load_mapping(path: str | os.PathLike[str], key: bytes) -> dict[str, str]:
    return decrypt_mapping(Path(path).read_bytes(), key)


def load_file_mapping(path: str | os.PathLike[str], key: bytes) -> dict[str, str]:
    """The input -> output file names ``securetrain deid --mapping-out`` stored (empty if none)."""
    return dict(_decrypt(Path(path).read_bytes(), key).get("files", {}))

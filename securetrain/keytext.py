"""Key material from text or a key file, in exactly one explicit encoding each.

A key typed or pasted with a one-character typo must be an error, never a *different* key (which
would silently give different pseudonyms, tokens or ciphertexts). Accepted forms:

* exactly 64 hex characters (32 bytes; surrounding whitespace ignored);
* ``hex:<hex digits>`` (any even length; at least ``min_bytes`` bytes);
* ``base64:<standard base64>`` (padding required; at least ``min_bytes`` bytes);
* key files only: exactly 32 raw bytes that are *not* text (e.g. ``head -c 32 /dev/urandom``).

Anything else is refused with a message that never echoes the value. :func:`check_key_file_mode`
warns when a key file is readable by group or others.
"""

from __future__ import annotations

import base64
import binascii
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from securetrain.errors import SecureTrainError

RAW_KEY_BYTES = 32
_HEX64 = re.compile(rb"[0-9a-fA-F]{64}")
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")
_B64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}")
_PRINTABLE = set(range(0x20, 0x7F)) | {0x09, 0x0A, 0x0D}
FORMS = "64 hex characters, 'hex:<hex>', 'base64:<base64>' or (key files) 32 raw bytes"
HINT = "generate one with: python -c 'import secrets; print(secrets.token_hex(32))'"


def _is_text(data: bytes) -> bool:
    return all(b in _PRINTABLE for b in data)


def decode_key(data: bytes | str, *, what: str, error: type[SecureTrainError], min_bytes: int = 16,
               allow_raw: bool = False) -> bytes:
    """Decode key material in one of the explicit forms above; ``error`` is raised otherwise.

    ``allow_raw`` admits 32 raw (non-text) bytes, for key files. The message names ``what`` and the
    accepted forms, never the value."""
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else bytes(data)
    if not raw.strip():
        raise error(f"{what} is empty", hint=HINT)
    if not _is_text(raw):
        if allow_raw and len(raw) == RAW_KEY_BYTES:
            return raw
        raise error(f"{what} is neither text nor exactly {RAW_KEY_BYTES} raw bytes", hint=f"use {FORMS}")
    text = raw.strip()
    low = text[:7].lower()
    if low.startswith(b"hex:"):
        body = text[4:].strip()
        if not _HEX.fullmatch(body):
            raise error(f"{what}: the value after 'hex:' is not hex (an even number of 0-9a-f)", hint=HINT)
        key = bytes.fromhex(body.decode("ascii"))
    elif low.startswith(b"base64:"):
        body = text[7:].strip()
        try:
            if not _B64.fullmatch(body) or len(body) % 4:
                raise ValueError
            key = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise error(f"{what}: the value after 'base64:' is not valid base64 (with padding)", hint=HINT) from None
    elif _HEX64.fullmatch(text):
        key = bytes.fromhex(text.decode("ascii"))
    else:
        raise error(f"{what} is not in an accepted form ({len(text)} characters)", hint=f"use {FORMS}")
    if len(key) < min_bytes:
        raise error(f"{what} decodes to {len(key)} bytes; at least {min_bytes} are required", hint=HINT)
    return key


def group_or_other_readable(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False


def check_key_file_mode(path: Path, *, warn: Callable[[str], object] | None = None) -> bool:
    """Warn (one line on stderr, or through ``warn``) when ``path`` is readable by group/others."""
    if not group_or_other_readable(path):
        return False
    message = f"warning: key file {path} is readable by group/others (fix: chmod 600 {path})"
    if warn is None:
        print(message, file=sys.stderr)
    else:
        warn(message)
    return True

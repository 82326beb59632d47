"""Deprecated alias: import the container API from :mod:`securetrain.crypto` instead.

``securetrain.crypto.stream`` was the one-file streaming AEAD container. Its internals now live
in the private ``securetrain.crypto._container`` package (format, key schedule, writer, reader,
files); the public names are exported by ``securetrain.crypto``. This module re-exports those
public names so existing code keeps working, and warns once on import. Only public names are
here: ``open_header`` and the ``_private`` helpers are gone; ``rewrap_file`` returns a frozen
``RewrapResult`` (``.old``, ``.new``) instead of a tuple.
"""

from __future__ import annotations

import warnings

from securetrain.crypto._container import (
    DEFAULT_SEGMENT_SIZE,
    GCM_MAX_PLAINTEXT_BYTES,
    MAGIC,
    MAX_SEGMENT_SIZE,
    VERSION,
    DecryptingReader,
    EncryptingWriter,
    Header,
    RewrapResult,
    Stanza,
    decrypt_bytes,
    decrypt_file,
    decrypt_stream,
    encrypt_bytes,
    encrypt_file,
    encrypt_stream,
    inspect_file,
    read_header,
    readinto_full,
    rewrap_file,
    segment_count,
    signer_fingerprint,
    unwrap_data_key,
    verify_stream,
)

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "GCM_MAX_PLAINTEXT_BYTES",
    "MAGIC",
    "MAX_SEGMENT_SIZE",
    "VERSION",
    "DecryptingReader",
    "EncryptingWriter",
    "Header",
    "RewrapResult",
    "Stanza",
    "decrypt_bytes",
    "decrypt_file",
    "decrypt_stream",
    "encrypt_bytes",
    "encrypt_file",
    "encrypt_stream",
    "inspect_file",
    "read_header",
    "readinto_full",
    "rewrap_file",
    "segment_count",
    "signer_fingerprint",
    "unwrap_data_key",
    "verify_stream",
]

warnings.warn("securetrain.crypto.stream is deprecated; import these names from securetrain.crypto",
              DeprecationWarning, stacklevel=2)

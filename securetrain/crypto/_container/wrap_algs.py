"""Stanza wrap algorithms (container header field ``wrap_alg``; see docs/checkpoint-format.md).

A leaf module, so that ``keys`` (local KEKs) and ``vault`` (transit provider) can both name the
algorithms without importing each other.
"""

from __future__ import annotations

WRAP_AES256_KW = 1  # RFC 3394 AES key wrap under a local 256-bit KEK (40-byte output)
WRAP_OPAQUE = 2  # provider-defined bytes (e.g. Vault transit ciphertext), opened by the provider

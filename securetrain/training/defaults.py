"""Secure defaults for a :class:`~securetrain.training.trainer.Trainer` built without a store or recorder.

* Checkpoints: when an operator key source is configured (``SECURETRAIN_KEYRING`` (+ passphrase),
  ``SECURETRAIN_VAULT_TRANSIT_KEY`` or ``SECURETRAIN_KEK``), the default store is the AES-256
  streaming-AEAD :class:`~securetrain.crypto.checkpoint.EncryptedCheckpointStore` under that key;
  plaintext safetensors only when no key source exists (local development).
* Auditing: when ``SECURETRAIN_AUDIT_URL`` is set, the trainer records into that hash-chained
  audit log (``training.start/stop``, every ``checkpoint.write``); otherwise it records nothing.
"""

from __future__ import annotations

import os
from typing import Any

from securetrain.audit.recorder import AuditRecorder
from securetrain.training.checkpoint_store import CheckpointStore
from securetrain.training.config import TrainingConfig

KEY_SOURCE_ENV = ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_KEK")
AUDIT_URL_ENV = "SECURETRAIN_AUDIT_URL"


def key_source_configured() -> bool:
    return any(os.environ.get(name) for name in KEY_SOURCE_ENV)


def default_checkpoint_store(config: TrainingConfig, audit: AuditRecorder | None) -> CheckpointStore:
    """Encrypted under the configured key source, else plaintext safetensors (development)."""
    directory = config.output_dir / "checkpoints"
    if key_source_configured():
        from securetrain.crypto.checkpoint import EncryptedCheckpointStore
        from securetrain.crypto.keys import provider_from_env

        return EncryptedCheckpointStore(directory, provider_from_env(), keep_last=config.keep_last, audit=audit)
    from securetrain.training.safetensors_store import SafetensorsCheckpointStore

    return SafetensorsCheckpointStore(directory, keep_last=config.keep_last, audit=audit)


def default_audit_log() -> Any | None:
    """The audit log ``$SECURETRAIN_AUDIT_URL`` names (signing key ``$SECURETRAIN_AUDIT_KEY``), or None."""
    url = os.environ.get(AUDIT_URL_ENV)
    if not url:
        return None
    from securetrain.audit.log import AuditLog

    return AuditLog(url, origin="securetrain/trainer")

"""securetrain.crypto: encrypted checkpoints, tensor transport and key management.

Modules (import what you need; this package imports nothing heavy so the CLI stays fast):

* ``stream`` - the streaming AEAD container (``encrypt_stream``, ``decrypt_stream``, files, re-wrap)
* ``keys`` - KEKs and providers (``LocalKeyring``, ``EnvKeyProvider``, ``KeyProvider``)
* ``rotation`` - fail-safe KEK rotation (``rotate_keyring``) and the key escrow
* ``private_file`` - ``private_writer`` (O_TMPFILE + linkat: a killed writer leaves nothing), temp sweeping
* ``vault`` - HashiCorp Vault transit provider (extra ``[vault]``)
* ``checkpoint`` - ``EncryptedCheckpointStore`` (safetensors inside the container)
* ``transport`` - sealed tensor messages, socket framing, torch.distributed helpers
* ``prefect_serializer`` - ``EncryptedTensorSerializer`` for Prefect results
* ``errors`` - the typed errors (all derive from ``CryptoError``)

Formats and threat model: ``docs/checkpoint-format.md``, ``docs/keys.md``, ``docs/tensor-transport.md``.
"""

"""Checkpoints signed through Vault transit: the private key never leaves Vault (a fake transit here)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from securetrain.audit.log import AuditLog
from securetrain.audit.signers import AuditSigningError, VaultTransitSigner


class FakeTransit:
    """hvac's transit API for one ed25519 key: read_key returns the public key, sign_data signs."""

    def __init__(self) -> None:
        self.keys = {1: Ed25519PrivateKey.generate()}
        self.signed = 0
        self.forge_with: Ed25519PrivateKey | None = None

    def read_key(self, name: str, mount_point: str = "transit") -> dict:
        from cryptography.hazmat.primitives import serialization

        raw = {str(v): {"public_key": base64.b64encode(k.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()} for v, k in self.keys.items()}
        return {"data": {"type": "ed25519", "latest_version": max(self.keys), "keys": raw}}

    def sign_data(self, name: str, hash_input: str, key_version: int | None = None, mount_point: str = "transit",
                  **_: object) -> dict:
        key = self.forge_with or self.keys[key_version or max(self.keys)]
        self.signed += 1
        sig = key.sign(base64.b64decode(hash_input))
        return {"data": {"signature": f"vault:v{key_version or max(self.keys)}:" + base64.b64encode(sig).decode()}}


class FakeClient:
    def __init__(self) -> None:
        self.secrets = type("S", (), {})()
        self.secrets.transit = FakeTransit()


def test_checkpoints_signed_in_vault_verify_with_its_public_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient()
    signer = VaultTransitSigner("audit", client=client)
    log = AuditLog(tmp_path / "audit.db", signing_key=signer, checkpoint_every=None)
    for i in range(5):
        log.record("dicom.read", f"r{i}")
    cp = log.checkpoint()
    assert cp.tree_size == 5 and client.secrets.transit.signed == 1
    assert log.verify().ok
    export = log.export(tmp_path / "export")
    from securetrain.audit.export import verify_export

    assert verify_export(export, public_key=signer.public_key()).ok
    log.close()
    # The auditor's stand-alone verifier, with the public key read from Vault and pinned.
    import subprocess
    import sys

    from securetrain.audit.keys import public_key_pem

    pinned = tmp_path / "vault-audit.pub.pem"
    pinned.write_bytes(public_key_pem(signer.public_key()))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-I", str(root / "audit" / "verify_audit.py"), str(export),
                           "--public-key", str(pinned)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_signature_by_another_key_is_refused_before_use(tmp_path: Path) -> None:
    client = FakeClient()
    signer = VaultTransitSigner("audit", client=client)
    log = AuditLog(tmp_path / "audit.db", signing_key=signer, checkpoint_every=None)
    log.record("a.b", "r")
    client.secrets.transit.forge_with = Ed25519PrivateKey.generate()  # replaced key / a man in the middle
    with pytest.raises(AuditSigningError, match="does not verify"):
        log.checkpoint()
    assert log.checkpoints() == []  # nothing unverifiable was stored
    log.close()


def test_vault_is_chosen_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient()
    monkeypatch.delenv("SECURETRAIN_AUDIT_KEY")
    monkeypatch.setenv("SECURETRAIN_AUDIT_VAULT_KEY", "audit")
    monkeypatch.setattr(VaultTransitSigner, "from_env",
                        classmethod(lambda cls, environ=None: cls("audit", client=client)))
    log = AuditLog(tmp_path / "audit.db", checkpoint_every=2)
    for i in range(4):
        log.record("a.b", f"r{i}")
    assert isinstance(log.signing_key, VaultTransitSigner) and log.verify().ok
    assert client.secrets.transit.signed >= 1
    log.close()

"""Keyring file, env KEK, Vault transit (mocked hvac), rotation and secret hygiene."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
from typing import Any

import pytest

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.crypto import _container as S
from securetrain.crypto.errors import (
    CryptoError,
    HeaderAuthError,
    KeyNotFoundError,
    KeyringError,
    KeyringPermissionError,
    WrongKeyError,
)
from securetrain.crypto.keys import EnvKeyProvider, KeyProvider, LocalKeyring, SecretKey, provider_from_env
from securetrain.crypto.vault import VaultTransitProvider

PASS = "correct horse battery"
FAST = 10  # scrypt log2(N) for tests; the default (15) is used by `keys init`


@pytest.fixture()
def keyring_file(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    ring = LocalKeyring.create("k1")
    path = tmp_path / "keyring.json"
    ring.save(path, log2_n=FAST)
    return path, ring


def test_keyring_round_trip_and_mode(keyring_file) -> None:
    path, ring = keyring_file
    assert (path.stat().st_mode & 0o777) == 0o600
    loaded = LocalKeyring.load(path)
    assert loaded.current_key_id() == "k1"
    assert loaded.keys()[0] == ring.keys()[0]
    raw = path.read_text()
    assert base64.b64encode(ring.keys()[0].material()).decode() not in raw
    assert ring.keys()[0].material().hex() not in raw


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_readable_keyring_is_refused(keyring_file, mode: int) -> None:
    path, _ = keyring_file
    os.chmod(path, mode)
    with pytest.raises(KeyringPermissionError, match="chmod 600"):
        LocalKeyring.load(path)


def test_wrong_passphrase_and_tampered_keyring(keyring_file) -> None:
    path, _ = keyring_file
    with pytest.raises(KeyringError, match="wrong passphrase"):
        LocalKeyring.load(path, "not the passphrase")
    doc = json.loads(path.read_text())
    doc["kdf"]["log2_n"] = 11  # parameter edit is authenticated (AAD)
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    with pytest.raises(KeyringError):
        LocalKeyring.load(path)


def test_missing_passphrase_and_keyring(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SECURETRAIN_KEYRING_PASSPHRASE", raising=False)
    with pytest.raises(KeyringError, match="passphrase"):
        LocalKeyring.create("k").save(tmp_path / "x.json")
    with pytest.raises(KeyringError, match="not found"):
        LocalKeyring.load(tmp_path / "nope.json", PASS)


def test_secret_key_never_shows_its_bytes() -> None:
    key = SecretKey.generate("k1")
    ring = LocalKeyring([key], "k1")
    m = key.material()
    for text in (repr(key), str(key), repr(ring), str(ring), f"{key}", repr([key])):
        assert m.hex() not in text and base64.b64encode(m).decode() not in text and str(m) not in text
        assert "k1" in text
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(TypeError):
        pickle.dumps(ring)


def test_error_messages_do_not_contain_key_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    key = SecretKey.generate("k1")
    blob = S.encrypt_bytes(b"x", LocalKeyring([key], "k1"))
    impostor = SecretKey("k1", os.urandom(32))
    with pytest.raises(WrongKeyError) as info:
        S.decrypt_bytes(blob, LocalKeyring([impostor], "k1"))
    text = str(info.value) + repr(info.value)
    for secret in (key.material(), impostor.material()):
        assert secret.hex() not in text and base64.b64encode(secret).decode() not in text
    bad = "zz" * 32
    monkeypatch.setenv("SECURETRAIN_KEK", bad)
    with pytest.raises(KeyringError) as info2:
        EnvKeyProvider()
    assert bad not in str(info2.value)


@pytest.mark.parametrize("encode", [bytes.hex, lambda b: base64.b64encode(b).decode(),
                                    lambda b: base64.urlsafe_b64encode(b).decode().rstrip("=")])
def test_env_kek(monkeypatch: pytest.MonkeyPatch, encode: Any) -> None:
    material = os.urandom(32)
    monkeypatch.setenv("SECURETRAIN_KEK", encode(material))
    monkeypatch.setenv("SECURETRAIN_KEK_ID", "prod-kek-1")
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    provider = provider_from_env()
    assert isinstance(provider, EnvKeyProvider) and isinstance(provider, KeyProvider)
    blob = S.encrypt_bytes(b"hello", provider)
    assert S.read_header(io.BytesIO(blob)).key_ids == ["prod-kek-1"]
    assert S.decrypt_bytes(blob, provider) == b"hello"
    assert material.hex() not in repr(provider)


def test_env_kek_wrong_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_KEK", base64.b64encode(os.urandom(16)).decode())
    with pytest.raises(KeyringError, match="32 bytes"):
        EnvKeyProvider()


# -- Vault transit with a mocked hvac client ---------------------------------------------------

class FakeTransit:
    """Behaves like hvac's transit API: ciphertext is "vault:v<N>:" + AES-GCM, key never returned."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.versions = {1: AESGCM(os.urandom(32))}
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _enc(self, plaintext_b64: str) -> str:
        v = max(self.versions)
        nonce = os.urandom(12)
        ct = self.versions[v].encrypt(nonce, base64.b64decode(plaintext_b64), None)
        return f"vault:v{v}:" + base64.b64encode(nonce + ct).decode()

    def encrypt_data(self, name: str, plaintext: str, mount_point: str = "transit") -> dict[str, Any]:
        self.calls.append(("encrypt", {"name": name, "mount_point": mount_point}))
        return {"data": {"ciphertext": self._enc(plaintext)}}

    def decrypt_data(self, name: str, ciphertext: str, mount_point: str = "transit") -> dict[str, Any]:
        self.calls.append(("decrypt", {"name": name, "mount_point": mount_point}))
        _, v, body = ciphertext.split(":", 2)
        raw = base64.b64decode(body)
        pt = self.versions[int(v[1:])].decrypt(raw[:12], raw[12:], None)  # raises InvalidTag if tampered
        return {"data": {"plaintext": base64.b64encode(pt).decode()}}

    def rewrap_data(self, name: str, ciphertext: str, mount_point: str = "transit") -> dict[str, Any]:
        plain = self.decrypt_data(name, ciphertext, mount_point)["data"]["plaintext"]
        return {"data": {"ciphertext": self._enc(plain)}}


class FakeHvac:
    def __init__(self) -> None:
        self.secrets = type("Secrets", (), {})()
        self.secrets.transit = FakeTransit()


def test_vault_transit_provider_round_trip() -> None:
    client = FakeHvac()
    vault = VaultTransitProvider("checkpoints", client=client)
    assert isinstance(vault, KeyProvider)
    blob = S.encrypt_bytes(b"weights" * 100, vault)
    h = S.read_header(io.BytesIO(blob))
    assert h.key_ids == ["vault:transit/checkpoints"] and h.stanzas[0].wrap_alg == 2
    assert h.stanzas[0].wrapped.startswith(b"vault:v1:")
    assert S.decrypt_bytes(blob, vault) == b"weights" * 100
    assert [c[0] for c in client.secrets.transit.calls] == ["encrypt", "decrypt"]


def test_vault_failure_is_typed_and_clean() -> None:
    client = FakeHvac()
    vault = VaultTransitProvider("checkpoints", client=client)
    blob = S.encrypt_bytes(b"x", vault)
    client.secrets.transit.versions = {1: type(client.secrets.transit.versions[1])(os.urandom(32))}
    with pytest.raises(WrongKeyError, match="Vault"):
        S.decrypt_bytes(blob, vault)
    with pytest.raises(KeyNotFoundError):
        vault.unwrap("vault:transit/other", b"vault:v1:xx")


def test_rewrap_from_local_keyring_to_vault(tmp_path) -> None:
    ring = LocalKeyring.create("local")
    path = tmp_path / "c.stenc"
    path.write_bytes(S.encrypt_bytes(os.urandom(500), ring, segment_size=64))
    vault = VaultTransitProvider("checkpoints", client=FakeHvac())
    S.rewrap_file(path, ring, new_provider=vault)
    assert S.inspect_file(path).key_ids == ["vault:transit/checkpoints"]
    with open(path, "rb") as fh:
        S.verify_stream(fh, vault)


# -- rotation ---------------------------------------------------------------------------------

def test_rotation_rewraps_without_reencrypting(keyring_file, tmp_path) -> None:
    path, _ = keyring_file
    ring = LocalKeyring.load(path)
    old_key = ring.keys()[0]
    data = os.urandom(5000)
    c = tmp_path / "model.stenc"
    c.write_bytes(S.encrypt_bytes(data, ring, segment_size=1024))
    before = c.read_bytes()
    old_header = S.read_header(io.BytesIO(before))

    new_key = ring.rotate("k2")
    ring.save(path, log2_n=FAST)
    audit = MemoryAuditRecorder()
    result = S.rewrap_file(c, ring, audit=audit)
    old, new = result.old, result.new
    assert result.key_id == "k2" and result.path == c
    assert audit.events == [{"action": "key.rewrap", "resource": "model.stenc", "outcome": "success", "details": {
        "old_key_ids": ["k1"], "new_key_id": "k2", "new_kek_fingerprint": new_key.fingerprint}}]
    after = c.read_bytes()

    assert new.key_ids == ["k2"] and old.key_ids == ["k1"]
    assert before[old_header.header_length:] == after[new.header_length:], "payload bytes must be unchanged"
    assert before[:61] == after[:61], "fixed header (salt, nonce prefix, sizes) unchanged"
    assert before[:old_header.header_length] != after[:new.header_length], "stanzas + MAC changed"
    assert new.stanzas[0].fingerprint.hex() == new_key.fingerprint

    # The old KEK is no longer needed: drop it, persist, reload - the file still decrypts.
    ring.remove("k1")
    ring.save(path, log2_n=FAST)
    only_new = LocalKeyring.load(path)
    assert only_new.key_ids() == ["k2"]
    assert S.decrypt_bytes(after, only_new) == data
    # ...and a keyring holding only the retired key cannot open it any more.
    with pytest.raises(KeyNotFoundError):
        S.decrypt_bytes(after, LocalKeyring([old_key], "k1"))


def test_rotated_away_key_cannot_decrypt_old_copy(tmp_path) -> None:
    """A backup encrypted under k1 fails with a typed error once k1 is removed."""
    ring = LocalKeyring.create("k1")
    blob = S.encrypt_bytes(b"secret", ring)
    ring.rotate("k2")
    ring.remove("k1")
    with pytest.raises(KeyNotFoundError, match="k1"):
        S.decrypt_bytes(blob, ring)


def test_rewrap_is_atomic_on_failure(tmp_path) -> None:
    ring = LocalKeyring.create("k1")
    c = tmp_path / "c.stenc"
    c.write_bytes(S.encrypt_bytes(os.urandom(3000), ring, segment_size=256))
    before = c.read_bytes()

    class Exploding(LocalKeyring):
        def wrap(self, key_id: str, data_key: bytes) -> bytes:
            raise KeyringError("KMS unavailable")

    broken = Exploding(ring.keys(), "k1")
    with pytest.raises(KeyringError):
        S.rewrap_file(c, broken)
    assert c.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.stenc"], "no temp files left behind"


def test_rewrap_refuses_tampered_or_truncated_file(tmp_path) -> None:
    ring = LocalKeyring.create("k1")
    c = tmp_path / "c.stenc"
    blob = S.encrypt_bytes(os.urandom(3000), ring, segment_size=256)
    c.write_bytes(blob[:-10])
    with pytest.raises(Exception) as info:
        S.rewrap_file(c, ring)
    assert type(info.value).__name__ == "TruncatedError"
    c.write_bytes(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    with pytest.raises(CryptoError):
        S.rewrap_file(c, ring)


def test_remove_current_key_refused() -> None:
    ring = LocalKeyring.create("k1")
    with pytest.raises(KeyringError, match="rotate first"):
        ring.remove("k1")
    with pytest.raises(KeyringError):
        ring.add(SecretKey.generate("k1"))
    with pytest.raises(KeyringError):
        SecretKey.generate("bad id with spaces")


def test_concurrent_rotations_under_the_lock_keep_every_key(keyring_file) -> None:
    import threading

    from securetrain.crypto.keys import keyring_lock

    path, _ = keyring_file
    errors: list[BaseException] = []

    def rotate(i: int) -> None:
        try:
            with keyring_lock(path):
                ring = LocalKeyring.load(path)
                ring.rotate(f"r{i}")
                ring.save(path, log2_n=FAST)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rotate, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(LocalKeyring.load(path).key_ids()) == sorted(["k1"] + [f"r{i}" for i in range(6)])


def test_multiple_recipients_and_rotation_keeps_the_others(tmp_path) -> None:
    ring = LocalKeyring.create("local-1")
    vault = VaultTransitProvider("breakglass", client=FakeHvac())
    data = os.urandom(3000)
    c = tmp_path / "c.stenc"
    with open(c, "wb") as out:
        S.encrypt_stream(io.BytesIO(data), out, ring, segment_size=512, recipients=[(vault, None)])
    assert S.inspect_file(c).key_ids == ["local-1", "vault:transit/breakglass"]
    assert S.decrypt_bytes(c.read_bytes(), ring) == data
    assert S.decrypt_bytes(c.read_bytes(), vault) == data
    ring.rotate("local-2")
    S.rewrap_file(c, ring)
    assert S.inspect_file(c).key_ids == ["local-2", "vault:transit/breakglass"]
    ring.remove("local-1")
    assert S.decrypt_bytes(c.read_bytes(), ring) == data
    assert S.decrypt_bytes(c.read_bytes(), vault) == data


def test_recipient_stanza_cannot_carry_a_different_data_key(tmp_path) -> None:
    """Invisible-salamander style: recipient B's stanza wraps another key -> B refuses (commitment)."""
    ring_a, ring_b = LocalKeyring.create("a"), LocalKeyring.create("b")
    blob = S.encrypt_bytes(b"for both", ring_a, recipients=[(ring_b, None)])
    h = S.read_header(io.BytesIO(blob))
    evil = S.Stanza("b", 1, h.stanzas[1].fingerprint, ring_b.wrap("b", os.urandom(32)))
    # the attacker cannot recompute the MAC for B's key without breaking the commitment
    body = h.fixed + bytes([2]) + h.stanzas[0].encode() + evil.encode() + h.commitment
    forged = body + h.mac + blob[h.header_length:]
    with pytest.raises(HeaderAuthError):  # A: the MAC covers B's edited stanza
        S.decrypt_bytes(forged, ring_a)
    with pytest.raises(WrongKeyError, match="commitment"):
        S.decrypt_bytes(forged, ring_b)


def test_provider_from_env_precedence(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_KEK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(KeyringError, match="no key source"):
        provider_from_env()
    monkeypatch.setenv("SECURETRAIN_KEK", os.urandom(32).hex())
    assert isinstance(provider_from_env(), EnvKeyProvider)
    monkeypatch.setenv("SECURETRAIN_VAULT_TRANSIT_KEY", "ckpt")
    monkeypatch.setenv("VAULT_ADDR", "http://127.0.0.1:1")  # never contacted: no call is made here
    vault = provider_from_env()
    assert isinstance(vault, VaultTransitProvider) and vault.current_key_id() == "vault:transit/ckpt"
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    LocalKeyring.create("file-key").save(tmp_path / "kr.json", log2_n=FAST)
    monkeypatch.setenv("SECURETRAIN_KEYRING", str(tmp_path / "kr.json"))
    assert provider_from_env().current_key_id() == "file-key"


@pytest.mark.parametrize("kind", ["symlink", "dangling", "dir"])
def test_keyring_save_refuses_a_path_that_is_not_a_regular_file(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                 kind: str) -> None:
    """Loading refuses a symlinked keyring; saving (`keys init`, `--force`) replaced the symlink with a
    file, or failed on a directory naming an internal temp. Both are refused with KeyringError naming
    the path, and the entry is left as it was."""
    from securetrain.crypto.errors import KeyringError

    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    path = tmp_path / "keyring.json"
    if kind == "symlink":
        (tmp_path / "real.json").write_text("{}")
        path.symlink_to(tmp_path / "real.json")
    elif kind == "dangling":
        path.symlink_to(tmp_path / "nowhere.json")
    else:
        path.mkdir()
    before = sorted((p.name, p.lstat().st_mode) for p in tmp_path.iterdir())
    with pytest.raises(KeyringError) as info:
        LocalKeyring.create("k1").save(path, log2_n=FAST)
    assert str(path) in str(info.value) and ".tmp" not in str(info.value), info.value
    assert sorted((p.name, p.lstat().st_mode) for p in tmp_path.iterdir()) == before


def test_keyring_lock_excludes_while_lock_files_come_and_go(tmp_path) -> None:
    """The lock file is removed by the run that created it; a waiter that opened the removed file
    must not think it holds the lock while a newer run holds one on a new file."""
    import threading

    from securetrain.crypto.keys import keyring_lock

    path = tmp_path / "ring.json"
    inside: list[int] = []
    overlaps: list[int] = []

    def worker() -> None:
        for _ in range(40):
            with keyring_lock(path):
                inside.append(1)
                if len(inside) > 1:
                    overlaps.append(len(inside))
                inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps
    assert not (tmp_path / "ring.json.lock").exists()

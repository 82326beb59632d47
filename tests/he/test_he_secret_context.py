"""The data owner's secret context at rest (sealed in the AEAD container) and the digest labels."""

from __future__ import annotations

import hashlib
import io
import os

import numpy as np
import pytest

ts = pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from securetrain.audit.recorder import MemoryAuditRecorder  # noqa: E402
from securetrain.cli.main import app  # noqa: E402
from securetrain.crypto import _container as stream  # noqa: E402
from securetrain.crypto.errors import (  # noqa: E402
    HeaderAuthError,
    KeyNotFoundError,
    SegmentAuthError,
    TrailingDataError,
    TruncatedError,
    WrongKeyError,
)
from securetrain.crypto.keys import EnvKeyProvider  # noqa: E402
from securetrain.errors import ConfigError, IntegrityError  # noqa: E402
from securetrain.he import DataOwner, compile_plan, container, save_sequential  # noqa: E402
from securetrain.he.errors import HEFormatError, HEKeyError, HEKeySourceError  # noqa: E402
from securetrain.he.params import choose_params  # noqa: E402
from securetrain.he.secret_store import (  # noqa: E402
    SEALED_MAGIC,
    SECRET_CONTEXT_AD,
    open_secret_context,
    seal_secret_context,
)

pytestmark = pytest.mark.he

KEK_A, KEK_B = "a1" * 32, "b2" * 32
KEY_ENV = ("SECURETRAIN_KEYRING", "SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_VAULT_TRANSIT_KEY",
           "SECURETRAIN_KEK", "SECURETRAIN_KEK_ID", "SECURETRAIN_AUDIT_URL")


@pytest.fixture(autouse=True)
def _no_ambient_keys(monkeypatch) -> None:  # noqa: ANN001
    for var in KEY_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def owner() -> DataOwner:
    return DataOwner(choose_params(1))


@pytest.fixture(scope="module")
def secret(owner: DataOwner) -> bytes:
    return owner.secret_context()


def _provider(kek: str, key_id: str = "env-kek") -> EnvKeyProvider:
    return EnvKeyProvider({"SECURETRAIN_KEK": kek, "SECURETRAIN_KEK_ID": key_id})


def _leaked_chunks(secret_context: bytes, blob: bytes, width: int = 24, stride: int = 997) -> int:
    """How many width-byte windows of TenSEAL's serialized context (secret key included) appear in
    ``blob``. Sampled across the whole protobuf; a plaintext copy hits every one."""
    frame = container.decode(secret_context).frames[0]
    windows = [frame[i:i + width] for i in range(0, len(frame) - width, stride)]
    assert len(windows) > 100
    return sum(w in blob for w in windows)


def _secret_key_bytes(owner: DataOwner) -> bytes:
    """The part of the serialization that only a private context has: the secret key itself."""
    full = owner._ctx.serialize(save_public_key=False, save_secret_key=True, save_galois_keys=False,
                                save_relin_keys=False)
    public = owner._ctx.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False,
                                  save_relin_keys=False)
    assert len(full) > len(public) + 10_000  # the secret key is large
    return full


def test_magic_and_ad_are_distinct() -> None:
    assert SEALED_MAGIC == stream.MAGIC
    assert container.MAGIC[: len(SEALED_MAGIC)] != SEALED_MAGIC
    assert SECRET_CONTEXT_AD and SECRET_CONTEXT_AD != b""


def test_sealed_secret_context_leaks_no_key_bytes(owner: DataOwner, secret: bytes) -> None:
    sealed = seal_secret_context(secret, _provider(KEK_A))
    assert sealed.startswith(SEALED_MAGIC) and not sealed.startswith(secret[:64])
    assert secret not in sealed and secret[:4096] not in sealed
    assert _leaked_chunks(secret, secret) > 100  # the check itself finds a plaintext copy
    assert _leaked_chunks(secret, sealed) == 0
    sk = _secret_key_bytes(owner)
    assert not any(sk[i:i + 32] in sealed for i in range(0, len(sk) - 32, 4093))
    plain, was_sealed = open_secret_context(sealed, _provider(KEK_A))
    assert was_sealed and plain == secret
    restored = DataOwner.from_secret_context(plain)
    assert restored.context_id == owner.context_id


def test_public_context_is_not_sealed_as_secret(owner: DataOwner) -> None:
    with pytest.raises(HEFormatError, match="public context"):
        seal_secret_context(owner.public_context(), _provider(KEK_A))


def test_wrong_key_and_tampering_fail_typed(secret: bytes) -> None:
    sealed = seal_secret_context(secret, _provider(KEK_A))
    with pytest.raises(WrongKeyError) as exc:  # same key id, other KEK: AES-KW unwrap fails
        open_secret_context(sealed, _provider(KEK_B), source="s.stctx")
    assert isinstance(exc.value, IntegrityError) and "s.stctx" in str(exc.value)
    with pytest.raises(KeyNotFoundError):  # a KEK under another id
        open_secret_context(sealed, _provider(KEK_A, "other"))

    header = stream.read_header(io.BytesIO(sealed))
    body = bytearray(sealed)
    body[header.header_length + 100] ^= 1  # one bit in the first segment
    with pytest.raises(SegmentAuthError):
        open_secret_context(bytes(body), _provider(KEK_A))
    hdr = bytearray(sealed)
    hdr[12] ^= 1  # segment size field in the fixed header
    with pytest.raises(HeaderAuthError):
        open_secret_context(bytes(hdr), _provider(KEK_A))
    mac = bytearray(sealed)
    mac[header.header_length - 1] ^= 1  # header MAC
    with pytest.raises(HeaderAuthError):
        open_secret_context(bytes(mac), _provider(KEK_A))
    with pytest.raises(TruncatedError):
        open_secret_context(sealed[:-17], _provider(KEK_A))
    with pytest.raises(TrailingDataError):
        open_secret_context(sealed + b"\0", _provider(KEK_A))


def test_other_container_under_same_kek_cannot_be_swapped_in(secret: bytes) -> None:
    # e.g. a checkpoint container (default associated data) made with the same KEK
    swapped = stream.encrypt_bytes(secret, _provider(KEK_A))
    with pytest.raises(SegmentAuthError) as exc:
        open_secret_context(swapped, _provider(KEK_A))
    assert "not a sealed secret context" in str(exc.value)


def test_plaintext_context_loads_with_warning_and_needs_no_key(secret: bytes) -> None:
    warnings: list[str] = []

    def no_provider():  # noqa: ANN202
        raise AssertionError("a plaintext context must not ask for a key")

    plain, was_sealed = open_secret_context(secret, no_provider, warn=warnings.append)
    assert plain == secret and not was_sealed
    assert len(warnings) == 1 and "UNENCRYPTED" in warnings[0]
    with pytest.raises(HEFormatError, match="bad magic"):
        open_secret_context(b"garbage" * 10, no_provider)


# --------------------------------------------------------------------------------------------- CLI

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, object]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("he-secret")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5))
    y = (x[:, 0] - x[:, 1] > 0).astype(np.int64)
    torch.manual_seed(0)
    model = nn.Linear(5, 1).double()
    np.save(root / "x.npy", x)
    np.save(root / "y.npy", y)
    save_sequential(model, root / "m.safetensors")
    return {"root": root, "x": x, "model": model, "path": root / "m.safetensors"}


def _run(args: list[str]):  # noqa: ANN202
    return CliRunner().invoke(app, ["he", *[str(a) for a in args]])


def test_keygen_without_key_source_fails_before_writing(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "keys"
    r = _run(["keygen", "--out-dir", out, "--depth", "1"])
    assert isinstance(r.exception, HEKeySourceError) and isinstance(r.exception, ConfigError)
    assert "SECURETRAIN_KEK" in r.exception.hint and "--keyring" in r.exception.hint
    assert not out.exists() or not any(out.iterdir())


def test_cli_round_trip_with_sealed_secret(files, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    root, keys = files["root"], tmp_path / "keys"
    monkeypatch.setenv("SECURETRAIN_KEK", KEK_A)
    r = _run(["keygen", "--out-dir", keys, "--model", files["path"]])
    assert r.exit_code == 0, r.output
    assert "encrypted under key 'env-kek'" in r.output
    secret_file, public_file = keys / "secret.stctx", keys / "public.stctx"
    assert secret_file.stat().st_mode & 0o077 == 0
    on_disk = secret_file.read_bytes()
    assert on_disk.startswith(SEALED_MAGIC)
    plain, _ = open_secret_context(on_disk, _provider(KEK_A))
    assert container.decode(plain).header["has_secret_key"] is True
    assert _leaked_chunks(plain, on_disk) == 0
    assert container.decode(public_file.read_bytes()).header["has_secret_key"] is False  # public stays plain

    r = _run(["encrypt", "--value-bound", "64", "--context", secret_file, "--features", root / "x.npy", "--out", tmp_path / "in.stcts"])
    assert r.exit_code == 0, r.output
    assert "WARNING" not in r.output

    r = _run(["evaluate", "--context", secret_file, "--model", files["path"], "--input", tmp_path / "in.stcts",
              "--out", tmp_path / "out.stcts"])
    assert isinstance(r.exception, HEKeyError)  # a sealed secret is refused by the evaluator too

    audit = MemoryAuditRecorder()
    monkeypatch.setattr("securetrain.he.cli._audit", lambda db: audit)
    r = _run(["evaluate", "--context", public_file, "--model", files["path"], "--input", tmp_path / "in.stcts",
              "--out", tmp_path / "out.stcts"])
    assert r.exit_code == 0, r.output
    plan = compile_plan(files["model"])
    file_sha = hashlib.sha256(files["path"].read_bytes()).hexdigest()
    assert file_sha != plan.sha256()
    assert f"model file sha256: {file_sha}" in r.output and f"plan sha256:       {plan.sha256()}" in r.output
    (ev,) = [e for e in audit.events if e["action"] == "he.evaluate"]
    assert ev["details"]["model_file_sha256"] == file_sha
    assert ev["details"]["plan_sha256"] == plan.sha256() == ev["details"]["model_sha256"]
    assert ev["resource"] == f"he-model:{plan.sha256()[:16]}"

    r = _run(["decrypt", "--context", secret_file, "--input", tmp_path / "out.stcts", "--max-abs", "1e6", "--out", tmp_path / "s.csv"])
    assert r.exit_code == 0, r.output
    assert plan.sha256() in r.output
    (dec,) = [e for e in audit.events if e["action"] == "he.decrypt"]
    assert dec["resource"] == ev["resource"] and dec["details"]["plan_sha256"] == plan.sha256()
    scores = np.loadtxt(tmp_path / "s.csv", delimiter=",")
    np.testing.assert_allclose(scores, plan.evaluate_plain(files["x"])[:, 0], atol=1e-4)

    # the same sealed file with the wrong KEK, or with no key source at all
    monkeypatch.setenv("SECURETRAIN_KEK", KEK_B)
    r = _run(["decrypt", "--context", secret_file, "--input", tmp_path / "out.stcts", "--max-abs", "1e6"])
    assert isinstance(r.exception, WrongKeyError) and isinstance(r.exception, IntegrityError)
    monkeypatch.delenv("SECURETRAIN_KEK")
    r = _run(["encrypt", "--value-bound", "64", "--context", secret_file, "--features", root / "x.npy", "--out", tmp_path / "in2.stcts"])
    assert isinstance(r.exception, HEKeySourceError)
    assert not (tmp_path / "in2.stcts").exists()

    # tampered on disk
    monkeypatch.setenv("SECURETRAIN_KEK", KEK_A)
    bad = bytearray(on_disk)
    bad[len(bad) // 2] ^= 0x40
    (tmp_path / "bad.stctx").write_bytes(bytes(bad))
    r = _run(["decrypt", "--context", tmp_path / "bad.stctx", "--input", tmp_path / "out.stcts", "--max-abs", "1e6"])
    assert isinstance(r.exception, SegmentAuthError)


def test_plan_prints_both_labelled_digests(files) -> None:  # noqa: ANN001
    r = _run(["plan", "--model", files["path"]])
    assert r.exit_code == 0, r.output
    file_sha = hashlib.sha256(files["path"].read_bytes()).hexdigest()
    assert f"model file sha256: {file_sha}" in r.output
    assert f"plan sha256:       {compile_plan(files['model']).sha256()}" in r.output


def test_insecure_plaintext_flag_warns_and_seal_secret_upgrades(files, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    keys = tmp_path / "keys"
    r = _run(["keygen", "--out-dir", keys, "--depth", "1", "--insecure-plaintext-secret"])
    assert r.exit_code == 0, r.output
    assert "WARNING" in r.output and "UNENCRYPTED" in r.output
    secret_file = keys / "secret.stctx"
    data = secret_file.read_bytes()
    assert data.startswith(container.MAGIC) and secret_file.stat().st_mode & 0o077 == 0

    r = _run(["encrypt", "--value-bound", "64", "--context", secret_file, "--features", files["root"] / "x.npy", "--out", tmp_path / "i"])
    assert r.exit_code == 0, r.output
    assert "UNENCRYPTED secret context" in r.output  # a plaintext secret still loads, loudly

    r = _run(["seal-secret", "--context", secret_file])
    assert isinstance(r.exception, HEKeySourceError)
    assert secret_file.read_bytes() == data  # untouched
    monkeypatch.setenv("SECURETRAIN_KEK", KEK_A)
    r = _run(["seal-secret", "--context", secret_file])
    assert r.exit_code == 0, r.output
    sealed = secret_file.read_bytes()
    assert sealed.startswith(SEALED_MAGIC) and _leaked_chunks(data, sealed) == 0
    assert open_secret_context(sealed, _provider(KEK_A))[0] == data
    r = _run(["encrypt", "--value-bound", "64", "--context", secret_file, "--features", files["root"] / "x.npy", "--out", tmp_path / "i2"])
    assert r.exit_code == 0 and "WARNING" not in r.output, r.output
    r = _run(["seal-secret", "--context", keys / "public.stctx"])
    assert isinstance(r.exception, HEFormatError)  # refuses to "seal" a public context


def test_keygen_with_keyring_file(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from securetrain.crypto import keys as crypto_keys
    from securetrain.crypto.keys import LocalKeyring

    monkeypatch.setattr(crypto_keys, "SCRYPT_DEFAULT_LOG2_N", 10)
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", "correct horse battery")
    ring = LocalKeyring.create("he-owner")
    ring.save(tmp_path / "ring.json")
    assert oct(os.stat(tmp_path / "ring.json").st_mode & 0o777) == "0o600"
    r = _run(["keygen", "--out-dir", tmp_path / "k", "--depth", "1", "--keyring", tmp_path / "ring.json"])
    assert r.exit_code == 0, r.output
    sealed = (tmp_path / "k" / "secret.stctx").read_bytes()
    assert stream.read_header(io.BytesIO(sealed)).key_ids == ["he-owner"]
    plain, _ = open_secret_context(sealed, LocalKeyring.load(tmp_path / "ring.json"))
    assert DataOwner.from_secret_context(plain).params == choose_params(1)
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", "wrong passphrase!")
    r = _run(["encrypt", "--value-bound", "64", "--context", tmp_path / "k" / "secret.stctx", "--keyring", tmp_path / "ring.json",
              "--features", tmp_path / "none.npy", "--out", tmp_path / "o"])
    assert isinstance(r.exception, ConfigError) and not (tmp_path / "o").exists()

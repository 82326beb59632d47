"""A production-shaped run (secrets from the environment, no demo secrets) as the operations docs
describe it: what it needs is checked before any work, and user data it cannot train on is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from securetrain.pipeline import load_pipeline_config, run_pipeline
from securetrain.pipeline.errors import SigningKeyError
from tests.pipeline.pipeline_fixtures import small_config_data


@pytest.fixture
def production_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from securetrain.audit.keys import load_or_create_signing_key

    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_PROVENANCE_KEY",
                "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", os.urandom(32).hex())
    monkeypatch.setenv("SECURETRAIN_DEID_KEY", os.urandom(32).hex())
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    load_or_create_signing_key(keys / "audit.pem")
    monkeypatch.setenv("SECURETRAIN_AUDIT_KEY", str(keys / "audit.pem"))
    return keys


def test_missing_provenance_key_fails_before_any_work(tmp_path: Path, production_env: Path) -> None:
    config = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False}))
    with pytest.raises(SigningKeyError) as info:
        run_pipeline(config)
    message = str(info.value)
    assert "provenance signing key not found" in message and "securetrain release keygen" in message
    assert "SECURETRAIN_PROVENANCE_KEY" in message and "release.provenance: false" in message
    assert not (config.run_dir / "raw").exists() and not (config.run_dir / "checkpoints").exists()


def test_unsafe_provenance_key_is_named_as_such(tmp_path: Path, production_env: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.pipeline.secrets import check_provenance_key

    key = production_env / "prov.pem"
    key.write_text("not a key")
    key.chmod(0o644)
    monkeypatch.setenv("SECURETRAIN_PROVENANCE_KEY", str(key))
    config = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False}))
    with pytest.raises(SigningKeyError, match="provenance signing key .* readable by others"):
        check_provenance_key(config)
    key.chmod(0o600)
    with pytest.raises(SigningKeyError, match="provenance signing key .* not an unencrypted PEM"):
        check_provenance_key(config)
    off = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False},
                                                      release={"provenance": False}))
    check_provenance_key(off)  # not needed, not checked

"""Every stage resolves the run's secrets; the keyring's scrypt runs once per process and file."""

from __future__ import annotations

import os
import time
from pathlib import Path

from securetrain.crypto.keys import LocalKeyring
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.secrets import load_run_secrets

from .pipeline_fixtures import small_config_data


def test_keyring_opens_once_and_reopens_when_replaced(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    for name in ("SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_KEYRING", "SECURETRAIN_KEK",
                 "SECURETRAIN_VAULT_TRANSIT_KEY"):  # other tests' runs may have exported these
        monkeypatch.delenv(name, raising=False)
    config = load_pipeline_config(data=small_config_data(tmp_path, name="s"))
    calls = []
    real = LocalKeyring.load.__func__  # type: ignore[attr-defined]

    def counting(cls, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(args)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(LocalKeyring, "load", classmethod(counting))
    first = load_run_secrets(config)
    second = load_run_secrets(config)
    assert len(calls) == 1 and second.keyring is first.keyring

    # The keyring file is replaced (rotation, restore from backup): the new file is opened.
    path = config.run_dir / "keys" / "keyring.json"
    passphrase = (config.run_dir / "keys" / "keyring.passphrase").read_text().strip()
    replacement = LocalKeyring.create("rotated-kek")
    replacement.save(path.with_suffix(".new"), passphrase=passphrase)
    time.sleep(0.01)
    os.replace(path.with_suffix(".new"), path)
    third = load_run_secrets(config)
    assert len(calls) == 2 and third.keyring.current_key_id() == "rotated-kek"

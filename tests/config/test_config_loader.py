from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from securetrain.config.loader import load_model
from securetrain.errors import ConfigError


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: int = 1
    flag: bool = False


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "x"
    training: Inner = Inner()


def test_yaml_and_toml_load_the_same(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("name: a\ntraining: {epochs: 3}\n")
    (tmp_path / "c.toml").write_text('name = "a"\n[training]\nepochs = 3\n')
    assert load_model(Outer, tmp_path / "c.yaml", environ={}) == load_model(Outer, tmp_path / "c.toml", environ={})


def test_env_overrides_nest_and_parse_scalars() -> None:
    env = {"SECURETRAIN_TRAINING__EPOCHS": "7", "SECURETRAIN_TRAINING__FLAG": "true"}
    cfg = load_model(Outer, environ=env)
    assert cfg.training.epochs == 7 and cfg.training.flag is True


def test_secret_variables_are_not_overrides() -> None:
    # These carry secrets for other components; they must neither break nor enter the config.
    env = {"SECURETRAIN_DEID_KEY": "00" * 32, "SECURETRAIN_KEYRING_PASSPHRASE": "p", "SECURETRAIN_AUDIT_URL": "x"}
    assert load_model(Outer, environ=env) == Outer()


def test_invalid_values_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"training\.epochs"):
        load_model(Outer, data={"training": {"epochs": "many"}}, environ={})
    with pytest.raises(ConfigError, match=r"training\.bogus"):
        load_model(Outer, environ={"SECURETRAIN_TRAINING__BOGUS": "1"})
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_model(Outer, tmp_path / "bad.yaml", environ={})
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_model(Outer, tmp_path / "list.yaml", environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_model(Outer, tmp_path / "missing.yaml", environ={})

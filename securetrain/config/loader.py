"""Load pydantic models from YAML or TOML, with ``SECURETRAIN_`` environment overrides.

Overrides use ``__`` as the nesting separator: ``SECURETRAIN_TRAINING__EPOCHS=3`` sets
``training.epochs``. Only names with a ``__`` are overrides, so the secret-carrying variables
(``SECURETRAIN_DEID_KEY``, ``SECURETRAIN_KEYRING_PASSPHRASE``, …) never reach a config model.
Values are parsed as YAML scalars, so ``3`` is an int and ``true`` a bool.
Any validation failure becomes one :class:`~securetrain.errors.ConfigError` naming the field(s).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from securetrain.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

ENV_PREFIX = "SECURETRAIN_"


def load_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file into a dict."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}", hint="check the path")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {file} is not UTF-8 text", hint="pass a .yaml or .toml file") from None
    try:
        if file.suffix == ".toml":
            data = tomllib.loads(text)
        elif file.suffix in {".yaml", ".yml"}:
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"unsupported config format {file.suffix!r} for {file}", hint="use .yaml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot parse {file}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must contain a mapping at the top level, got {type(data).__name__}")
    return data


def _env_overrides(environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(prefix):
            continue
        if prefix == ENV_PREFIX and "__" not in key[len(prefix):]:
            continue  # SECURETRAIN_DEID_KEY & co. carry secrets for other components, not config
        path = [part.lower() for part in key[len(prefix):].split("__") if part]
        if not path:
            continue
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {key} conflicts with another override")
        try:
            node[path[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            node[path[-1]] = raw
    return overrides


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def format_validation_error(exc: ValidationError, source: str) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        problems.append(f"{where}: {err['msg']}")
    return f"invalid configuration in {source}: " + "; ".join(problems)


def load_model(
    model: type[M],
    path: str | os.PathLike[str] | None = None,
    *,
    data: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> M:
    """Build ``model`` from a file and/or mapping, then apply environment overrides."""
    merged: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        merged = load_mapping(path)
        source = str(path)
    if data:
        merged = _deep_merge(merged, data)
    merged = _deep_merge(merged, _env_overrides(os.environ if environ is None else environ, env_prefix))
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None

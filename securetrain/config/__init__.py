"""Configuration: pydantic models loaded from YAML/TOML files with environment overrides."""

from securetrain.config.loader import load_mapping, load_model

__all__ = ["load_model", "load_mapping"]

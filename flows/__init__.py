"""Prefect flows: thin wrappers over :mod:`securetrain.pipeline`."""

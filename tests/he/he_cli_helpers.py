"""Shared by the HE CLI tests: small CKKS parameters, the `securetrain he` runner, and rebuilding a
ciphertext bundle with other frames or header fields (what a dishonest party would send)."""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from securetrain.cli.main import app
from securetrain.he import container

#: keygen parameters small enough for fast tests (one multiplication level).
SMALL_PARAMS = ("--poly-modulus-degree", "4096", "--coeff-bits", "38,30,38", "--scale-bits", "30")


def run_he(*args: object) -> Any:
    """``securetrain he ARGS...`` in process (CliRunner result)."""
    return CliRunner().invoke(app, ["he", *[str(a) for a in args]])


def rebundle(bundle: bytes, frames: list[bytes] | None = None, **header: object) -> bytes:
    """``bundle`` re-encoded with ``frames`` (default: its own) and ``header`` fields changed."""
    c = container.decode(bundle, expect_kind="he-ciphertexts")
    fields = {k: v for k, v in c.header.items() if k not in ("frames", "kind")} | header
    return container.encode("he-ciphertexts", fields, list(c.frames) if frames is None else frames)

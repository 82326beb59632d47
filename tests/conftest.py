"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest

POSTGRES_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def _no_network_analytics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DO_NOT_TRACK", "1")

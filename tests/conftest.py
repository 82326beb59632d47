"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest

POSTGRES_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def _no_network_analytics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def operator_audit_key(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The audit signing key an operator creates once with `securetrain audit keygen`."""
    from securetrain.audit.keys import create_signing_key

    path = tmp_path_factory.mktemp("operator-keys") / "audit-signing.pem"
    create_signing_key(path)
    return str(path)


@pytest.fixture(autouse=True)
def _operator_audit_key(operator_audit_key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Library code never creates an audit signing key; tests run as a deployment whose operator
    # did (SECURETRAIN_AUDIT_KEY). Tests of the missing-key path delete the variable.
    monkeypatch.setenv("SECURETRAIN_AUDIT_KEY", operator_audit_key)

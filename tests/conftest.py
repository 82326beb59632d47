"""Shared test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

POSTGRES_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def _no_network_analytics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session", autouse=True)
def operator_audit_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The audit signing key an operator creates once with `securetrain audit keygen`.

    Library code never creates an audit signing key; tests run as a deployment whose operator did
    (SECURETRAIN_AUDIT_KEY), set for the whole session so module-scoped fixtures (whole pipeline
    runs) and the tests reading their logs see the same key. Tests of the missing-key path delete it.
    """
    from securetrain.audit.keys import create_signing_key

    path = tmp_path_factory.mktemp("operator-keys") / "audit-signing.pem"
    create_signing_key(path)
    before = os.environ.get("SECURETRAIN_AUDIT_KEY")
    os.environ["SECURETRAIN_AUDIT_KEY"] = str(path)
    yield str(path)
    if before is None:
        os.environ.pop("SECURETRAIN_AUDIT_KEY", None)
    else:
        os.environ["SECURETRAIN_AUDIT_KEY"] = before

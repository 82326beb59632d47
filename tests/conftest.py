"""Shared test fixtures."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests send SIGINT to child processes (an interrupted run must exit 130 and clean up). A runner
# started as a background job of a non-interactive shell ignores SIGINT, and every child would
# inherit that; restore Python's own handler so children start with the default disposition.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

POSTGRES_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
POSTGRES_LIBPQ = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture
def pg_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh schema name on the test PostgreSQL (the test is skipped when it is unreachable),
    dropped afterwards; ``SECURETRAIN_DATA_DIR`` is the test's ``tmp_path``."""
    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(POSTGRES_LIBPQ, connect_timeout=3).close()
    except psycopg.OperationalError:
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_LIBPQ}")
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    name = f"st_test_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(POSTGRES_LIBPQ, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


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

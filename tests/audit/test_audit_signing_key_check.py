"""AuditLog.check_signing_key: a writer whose key cannot continue the log's signatures is refused
(a configuration error), while the log's own key, and the key it was handed over to, pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.audit.errors import AuditConfigError
from securetrain.audit.keys import create_signing_key
from securetrain.audit.log import AuditLog


def _key(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.pem"
    create_signing_key(path)
    return path


def test_own_key_and_handed_over_key_pass_another_key_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "audit.db")
    a, b, c = (_key(tmp_path, n) for n in "abc")
    with AuditLog(url, signing_key=a, checkpoint_every=None) as log:
        log.check_signing_key()  # no checkpoint yet: any key may start the log
        log.record("x", "1")
        log.checkpoint()
        log.check_signing_key()
        log.rotate_key(b)
    with AuditLog(url, signing_key=b, checkpoint_every=None) as log:
        log.check_signing_key()  # takes over from a: a's checkpoints verify through the hand-over
    with AuditLog(url, signing_key=c, checkpoint_every=None) as log, \
            pytest.raises(AuditConfigError, match="signed by another key"):
        log.check_signing_key()
    with AuditLog(url, signing_key=a, checkpoint_every=None) as log, pytest.raises(AuditConfigError, match="retired"):
        log.check_signing_key()

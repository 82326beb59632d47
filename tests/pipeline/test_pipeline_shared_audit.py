"""One audit log for many runs (the production shape: one PostgreSQL log, or one SQLite file, for a
team's runs): runs with different names append to it and each run's verification passes.

Before, each run signed the shared log's checkpoints under its own origin (``securetrain/<name>``):
the second run was refused before signing ("this log's checkpoints are signed for origin
'securetrain/<first>'"), and earlier still its export failed verification for good.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from securetrain.audit.errors import AuditConfigError
from securetrain.audit.keys import create_signing_key
from securetrain.audit.log import AuditLog
from securetrain.audit.note import parse_checkpoint_text, parse_note
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import open_run_audit, run_pipeline
from securetrain.pipeline.secrets import run_audit_key_path

from .pipeline_fixtures import finance_config

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")


def _config(tmp_path: Path, name: str, **audit: object):
    data = finance_config(tmp_path, name=name, he={"enabled": False},
                          audit={"url": str(tmp_path / "shared-audit.db"), "signing_key": str(tmp_path / "audit.pem"),
                                 **audit})
    data["training"].update(epochs=1)
    return load_pipeline_config(data=data)


def _origins(config) -> set[str]:  # noqa: ANN001
    with open_run_audit(config) as log:
        return {parse_checkpoint_text(parse_note(cp.note)[0])[0] for cp in log.checkpoints()}


def test_runs_with_different_names_share_one_log(tmp_path: Path) -> None:
    create_signing_key(tmp_path / "audit.pem")
    first = run_pipeline(_config(tmp_path, "fraud-a"))
    second_config = _config(tmp_path, "fraud-b")
    second = run_pipeline(second_config)
    for result in (first, second):
        assert result.audit is not None and result.audit.verified, result.audit.verifier_output
    assert len(_origins(second_config)) == 1
    with open_run_audit(second_config) as log:
        assert log.verify().ok
        starts = [e.resource for e in log.entries() if e.action == "pipeline.start"]
    assert starts == ["run:fraud-a", "run:fraud-b"]  # both runs on the one log


def test_a_configured_origin_names_the_log(tmp_path: Path) -> None:
    create_signing_key(tmp_path / "audit.pem")
    config = _config(tmp_path, "fraud-a", origin="acme.example/audit/finance")
    result = run_pipeline(config)
    assert result.audit is not None and result.audit.verified, result.audit.verifier_output
    assert _origins(config) == {"acme.example/audit/finance"}


def test_a_run_with_another_key_is_refused_before_it_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's demo key (secrets.create_demo_secrets, no audit.signing_key) is a new key: on a shared
    log the second run's checkpoints would be a second, unverifiable history of signatures. Before,
    it trained, signed and ended with a failed verification; now it stops before recording."""
    monkeypatch.delenv("SECURETRAIN_AUDIT_KEY")  # the session's shared test key would be used by both runs
    def demo_keyed(name: str):  # noqa: ANN202
        data = finance_config(tmp_path, name=name, he={"enabled": False},
                              audit={"url": str(tmp_path / "shared-audit.db")})
        data["training"].update(epochs=1)
        return load_pipeline_config(data=data)

    first_config = demo_keyed("fraud-a")
    first = run_pipeline(first_config)
    assert first.audit is not None and first.audit.verified
    first_key = run_audit_key_path(first_config)
    with AuditLog(str(tmp_path / "shared-audit.db"), signing_key=first_key) as log:
        before = log.size()
    with pytest.raises(AuditConfigError, match="signed by another key"):
        run_pipeline(demo_keyed("fraud-b"))
    with AuditLog(str(tmp_path / "shared-audit.db"), signing_key=first_key) as log:
        assert log.size() == before  # nothing of the refused run
        assert log.verify().ok

"""The whole pipeline as a plain library call (no Prefect): outputs, leaks, tampering, fail-closed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline

from .pipeline_fixtures import ROOT, planted_phi, small_config_data

pytest.importorskip("tenseal", reason="the pipeline's HE stage needs tenseal ([he] extra)")


@pytest.fixture(scope="module")
def library_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("pipeline")
    config = load_pipeline_config(data=small_config_data(tmp, name="lib"))
    return config, run_pipeline(config)


def test_every_stage_produces_its_output(library_run) -> None:
    config, result = library_run
    assert result.deid.files_in > result.deid.files_out > 0
    assert result.deid.rejected > 0  # the synthetic set includes burned-in US/SC images
    assert result.training.steps > 0 and result.training.device == "cpu"
    assert result.training.checkpoints and all(c.path.suffix == ".stenc" and c.key_id for c in result.training.checkpoints)
    assert result.he is not None
    assert result.he.max_abs_error < 1e-3
    assert round(result.he.encrypted_auc, 3) == round(result.he.plaintext_auc, 3)
    assert result.audit is not None and result.audit.verified, result.audit.verifier_output
    assert result.curve_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = result.report_html.read_text()
    assert "<h2>Homomorphic evaluation" in html and result.audit.root_hash in html


def test_no_planted_phi_anywhere_in_the_outputs(library_run) -> None:
    config, result = library_run
    phi = {v.encode() for v in planted_phi(config.run_dir)}
    assert len(phi) > 50
    scanned = 0
    for path in config.run_dir.rglob("*"):
        rel = path.relative_to(config.run_dir)
        if not path.is_file() or rel.parts[0] in {"raw", "keys"}:  # raw = the input PHI, by design
            continue
        data = path.read_bytes()
        upper = data.upper()
        leaks = [v for v in phi if v in data or v.upper() in upper]
        assert not leaks, f"{rel} contains planted PHI: {sorted(leaks)[:3]}"
        scanned += 1
    assert scanned > 20


def test_audit_log_covers_every_stage(library_run) -> None:
    from securetrain.pipeline.runner import open_run_audit

    config, result = library_run
    with open_run_audit(config) as log:  # the run's own signing key: another key must not verify
        actions = {e.action for e in log.entries()}
        assert log.verify().ok
    assert {"pipeline.start", "deid.policy_applied", "dicom.read", "deid.reject", "training.start", "checkpoint.write",
            "training.stop", "checkpoint.read", "he.evaluate", "pipeline.stop"} <= actions


def test_tampered_checkpoint_is_refused(library_run, tmp_path: Path) -> None:
    import shutil

    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.pipeline.stages import load_trained_model

    config, result = library_run
    copy = config.model_copy(deep=True)
    copy.output_dir = tmp_path
    shutil.copytree(config.run_dir, copy.run_dir)
    latest = max((copy.run_dir / "checkpoints").glob("*.stenc"))
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0x01
    latest.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        load_trained_model(copy, load_run_secrets(copy))


def test_standalone_verifier_catches_an_edited_export(library_run, tmp_path: Path) -> None:
    import shutil

    config, result = library_run
    export = tmp_path / "export"
    shutil.copytree(result.audit.export_dir, export)
    verifier = [sys.executable, "-I", str(ROOT / "audit" / "verify_audit.py"), str(export),
                "--public-key", str(config.run_dir / "audit-public-key.pem")]
    assert subprocess.run(verifier, capture_output=True).returncode == 0
    entries = export / "entries.jsonl"
    lines = entries.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"success"', b'"failure"', 1)
    entries.write_bytes(b"".join(lines))
    proc = subprocess.run(verifier, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_missing_secrets_fail_closed_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_KEK", "SECURETRAIN_DEID_KEY"):
        monkeypatch.delenv(var, raising=False)
    config = load_pipeline_config(data=small_config_data(tmp_path, secrets={"create_demo_secrets": False}))
    with pytest.raises(SecureTrainError) as info:
        run_pipeline(config)
    assert "passphrase" in str(info.value).lower() or "keyring" in str(info.value).lower()
    assert not (config.run_dir / "raw").exists()  # nothing was ingested


def test_invalid_config_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"training\.epochs"):
        load_pipeline_config(data=small_config_data(tmp_path, training={"epochs": 0}))
    with pytest.raises(ConfigError, match=r"data\.nope"):
        load_pipeline_config(data=small_config_data(tmp_path, data={"nope": 1}))
    with pytest.raises(ConfigError, match="policy"):
        load_pipeline_config(data=small_config_data(tmp_path, data={"policy": "policies/missing.yaml"}))


def test_operator_key_source_wins_over_demo_keyring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from securetrain.crypto.keys import EnvKeyProvider
    from securetrain.pipeline.secrets import load_run_secrets

    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", os.urandom(32).hex())
    monkeypatch.setenv("SECURETRAIN_KEK_ID", "ops-kek")
    monkeypatch.setenv("SECURETRAIN_DEID_KEY", os.urandom(32).hex())
    config = load_pipeline_config(data=small_config_data(tmp_path))  # secret env vars do not break loading
    secrets = load_run_secrets(config)
    assert isinstance(secrets.keyring, EnvKeyProvider) and secrets.keyring_path is None
    assert secrets.keyring.current_key_id() == "ops-kek"
    assert "ops-kek" in repr(secrets) and os.environ["SECURETRAIN_DEID_KEY"] not in repr(secrets)
    assert not (config.run_dir / "keys" / "keyring.json").exists()


def test_sealing_again_checks_the_log_against_the_held_checkpoint(library_run, tmp_path: Path) -> None:
    import shutil

    from securetrain.pipeline.runner import open_run_audit
    from securetrain.pipeline.stages import seal_audit

    original, result = library_run
    config = original.model_copy(deep=True)
    config.output_dir = tmp_path
    shutil.copytree(original.run_dir, config.run_dir)
    held_path = config.run_dir / "audit-checkpoint.note"
    held = held_path.read_text()
    with open_run_audit(config) as log:
        log.record("pipeline.start", "run:again")
        sealed = seal_audit(config, log)
        assert sealed.verified, sealed.verifier_output
        assert "export's own public_key" not in sealed.verifier_output  # verified against the key we hold
        assert sealed.entries > result.audit.entries and held_path.read_text() != held
        # A held checkpoint the log is not consistent with (here: a forged size) fails the seal,
        # and the held checkpoint is kept rather than replaced by the suspicious head.
        lines = held_path.read_text().split("\n")
        lines[1] = str(int(lines[1]) + 1000)
        forged = "\n".join(lines)
        held_path.write_text(forged)
        log.record("pipeline.start", "run:third")
        failed = seal_audit(config, log)
    assert not failed.verified
    assert held_path.read_text() == forged

"""Commands record into the audit log named by --audit-db / $SECURETRAIN_AUDIT_URL."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from securetrain.audit.log import AuditLog
from securetrain.cli.main import app

PASS = "integration passphrase"


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", PASS)
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SECURETRAIN_AUDIT_URL", str(tmp_path / "audit.db"))
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_KEK", "SECURETRAIN_DEID_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("securetrain.crypto.keys.SCRYPT_DEFAULT_LOG2_N", 10)
    return tmp_path


def _events(tmp: Path) -> list:
    with AuditLog(tmp / "audit.db", create=False) as log:
        assert log.verify().ok
        return list(log.entries())


def test_key_lifecycle_and_decryption_are_audited(env: Path) -> None:
    runner = CliRunner()
    kr, plain, enc, out = env / "kr.json", env / "w.bin", env / "w.stenc", env / "w.out"
    plain.write_bytes(b"weights" * 1000)
    assert runner.invoke(app, ["keys", "init", "--keyring", str(kr), "--key-id", "k1"]).exit_code == 0
    r = runner.invoke(app, ["checkpoint", "encrypt", str(plain), str(enc), "--keyring", str(kr)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["keys", "rotate", "--keyring", str(kr), "--key-id", "k2", "--rewrap", str(enc), "--remove-old"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["checkpoint", "decrypt", str(enc), str(out), "--keyring", str(kr)])
    assert r.exit_code == 0, r.output
    events = _events(env)
    by_action = {e.action: e for e in events}
    assert by_action["key.create"].details["key_id"] == "k1"
    rotate = by_action["key.rotate"].details
    assert rotate["new_key_id"] == "k2" and rotate["previous_key_ids"] == ["k1"] and rotate["rewrapped"] == 1
    assert "key.rewrap" in by_action
    decrypt = by_action["checkpoint.decrypt"].details
    assert decrypt["ciphertext_sha256"] == hashlib.sha256(enc.read_bytes()).hexdigest()
    assert decrypt["key_ids"] == ["k2"]
    text = "".join(str(e.details) for e in events)
    assert PASS not in text and _kek_hex(kr) not in text


def _kek_hex(path: Path) -> str:
    from securetrain.crypto.keys import LocalKeyring

    return LocalKeyring.load(path, PASS).keys()[0].material().hex()


def test_deid_with_workers_records_every_file_read(env: Path) -> None:
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(env / "raw", n_patients=2, studies_per_patient=1, images_per_series=2,
                                  include_burned_in=True)
    manifest.unlink()
    (manifest.parent / "phi.json").unlink()  # DICOM only: burned-in files are rejected, none quarantined
    key = env / "deid.key"
    key.write_text("ab" * 32)
    r = CliRunner().invoke(app, ["deid", str(manifest.parent), str(env / "out"), "--policy",
                                 str(Path(__file__).resolve().parents[2] / "policies" / "dicom-basic.yaml"),
                                 "--key-file", str(key), "--workers", "2"])
    assert r.exit_code == 0, r.output  # rejections alone (the policy working) do not fail the run
    events = _events(env)
    reads = {e.details["sha256"] for e in events if e.action == "dicom.read"}
    dicoms = [p for p in (env / "raw").rglob("*.dcm")]
    assert reads == {hashlib.sha256(p.read_bytes()).hexdigest() for p in dicoms}
    assert sum(e.action == "deid.policy_applied" for e in events) == 1
    assert any(e.action == "deid.reject" and e.outcome == "refused" for e in events)

"""Signed provenance: written at the end of a run, verified offline by audit/verify_provenance.py,
and refused on every tampered part (statement, signature, model, audit log, data manifest, files)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

pytest.importorskip("opacus", reason="the shared run trains with DP ([privacy] extra)")

from release_fixtures import (  # noqa: E402
    EPSILON,
    copy_run,
    read_envelope,
    run_provenance_key,
    train_run,
    verify_cli,
    write_statement,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tmp_path_factory.mktemp("prov"))


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    return copy_run(trained, tmp_path)


def _container(run: Path) -> Path:
    _, st = read_envelope(run)
    return run / "checkpoints" / "best" / st["subject"][1]["name"]


def test_statement_content_and_offline_verification(run: Path) -> None:
    env, st = read_envelope(run)
    assert env["payloadType"] == "application/vnd.in-toto+json" and len(env["signatures"]) == 1
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    p = st["predicate"]
    result = json.loads((run / "result.json").read_text())
    assert st["subject"][1]["digest"]["sha256"] == hashlib.sha256(_container(run).read_bytes()).hexdigest()
    assert p["privacy"]["epsilon"] == result["training"]["privacy"]["epsilon"] <= EPSILON
    assert p["config"]["sha256"] == result["config_sha256"]
    assert p["maskingPolicy"]["sha256"] == hashlib.sha256(
        (Path(__file__).resolve().parents[2] / "policies" / "finance-pii.yaml").read_bytes()).hexdigest()
    assert p["software"]["version"] and p["device"]["worldSize"] == 1
    assert p["trainingData"]["leafCount"] >= 2 and p["validation"]["best"]["metric"] == "auc"
    assert "checkpoint" not in p["validation"]["best"]  # no local paths in a signed statement
    assert result["provenance"]["statement_sha256"] == hashlib.sha256(
        __import__("base64").b64decode(env["payload"])).hexdigest()
    proc = verify_cli(run, "--model", str(_container(run)), "--data-manifest", str(run / "release" / "training-files.json"),
                      "--data-dir", str(run / "data"), "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"], out
    assert any("provenance.sign" in c for c in out["checks"])


def test_inclusion_proof_of_one_training_file(run: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    out = CliRunner().invoke(app, ["release", "prove", str(run), "train.parquet"])
    assert out.exit_code == 0, out.output
    proof = tmp_path / "proof.json"
    proof.write_text(out.output)
    ok = verify_cli(run, "--inclusion-proof", str(proof), "--file", str(run / "data" / "train.parquet"))
    assert ok.returncode == 0, ok.stderr
    # Another file under the same proof, or a forged proof, fails.
    bad = verify_cli(run, "--inclusion-proof", str(proof), "--file", str(run / "data" / "eval.parquet"))
    assert bad.returncode == 1 and "does not have the digest" in bad.stderr
    forged = json.loads(proof.read_text())
    forged["sha256"] = "00" * 32
    proof.write_text(json.dumps(forged))
    bad = verify_cli(run, "--inclusion-proof", str(proof))
    assert bad.returncode == 1 and "not proven" in bad.stderr


def test_edited_statement_fails(run: Path) -> None:
    _, st = read_envelope(run)
    st["predicate"]["privacy"]["epsilon"] = 0.5  # claim less privacy loss
    write_statement(run, st)
    proc = verify_cli(run)
    assert proc.returncode == 1 and "signature does not verify" in proc.stderr


def test_statement_signed_by_another_key_fails(run: Path) -> None:
    _, st = read_envelope(run)
    write_statement(run, st, key=Ed25519PrivateKey.generate())
    proc = verify_cli(run)
    assert proc.returncode == 1 and "not signed by the trusted provenance key" in proc.stderr


def test_tampered_model_fails(run: Path) -> None:
    container = _container(run)
    data = bytearray(container.read_bytes())
    data[len(data) // 2] ^= 1
    container.write_bytes(bytes(data))
    proc = verify_cli(run, "--model", str(container))
    assert proc.returncode == 1 and "matches no subject" in proc.stderr


def test_tampered_audit_log_fails(run: Path) -> None:
    entries = run / "audit-export" / "entries.jsonl"
    lines = entries.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b'"success"', b'"failure"')
    entries.write_bytes(b"\n".join(lines))
    proc = verify_cli(run)
    assert proc.returncode == 1 and "audit export does not verify" in proc.stderr


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda p: p["audit"].update(treeSize=p["audit"]["treeSize"] - 1), "not a signed checkpoint"),
    (lambda p: p["config"].update(sha256="0" * 64), "config digest"),
    (lambda p: p["run"].update(name="other"), "training.stop"),
])
def test_predicate_not_backed_by_the_log_fails(run: Path, edit, reason: str) -> None:
    """Even the provenance key's holder cannot claim a checkpoint, config or run the log does not show."""
    _, st = read_envelope(run)
    st = copy.deepcopy(st)
    edit(st["predicate"])
    write_statement(run, st, key=run_provenance_key(run))
    proc = verify_cli(run)
    assert proc.returncode == 1 and reason in proc.stderr, proc.stderr


def test_resigned_subject_fails_against_the_log(run: Path) -> None:
    _, st = read_envelope(run)
    st["subject"][1]["digest"]["sha256"] = "ab" * 32
    write_statement(run, st, key=run_provenance_key(run))
    proc = verify_cli(run)
    assert proc.returncode == 1 and "checkpoint.write" in proc.stderr


def test_replaced_statement_without_its_audit_event_fails(run: Path) -> None:
    """A statement re-signed after the run (validation metrics polished) has no provenance.sign event."""
    _, st = read_envelope(run)
    st["predicate"]["validation"]["best"]["value"] = 0.99
    write_statement(run, st, key=run_provenance_key(run))
    proc = verify_cli(run)
    assert proc.returncode == 1 and "provenance.sign" in proc.stderr


def test_tampered_training_data_fails(run: Path) -> None:
    manifest = run / "release" / "training-files.json"
    proc = verify_cli(run, "--data-manifest", str(manifest), "--data-dir", str(run / "data"))
    assert proc.returncode == 0, proc.stderr
    (run / "data" / "train.parquet").write_bytes(b"PAR1 replaced")
    proc = verify_cli(run, "--data-manifest", str(manifest), "--data-dir", str(run / "data"))
    assert proc.returncode == 1 and "train.parquet" in proc.stderr
    doc = json.loads(manifest.read_text())
    doc["files"] = doc["files"][1:]  # hide a file
    manifest.write_text(json.dumps(doc))
    proc = verify_cli(run, "--data-manifest", str(manifest))
    assert proc.returncode == 1 and "manifestSha256" in proc.stderr


def test_wrong_trusted_key_and_garbage_input(run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.pem"
    from cryptography.hazmat.primitives import serialization

    other.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    proc = verify_cli(run, public_key=other)
    assert proc.returncode == 1 and "trusted provenance key" in proc.stderr
    (run / "release" / "provenance.dsse.json").write_text("{not json")
    proc = verify_cli(run)
    assert proc.returncode == 1 and "not valid JSON" in proc.stderr

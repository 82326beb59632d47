"""The release gate: k-of-n signed approvals, ε and metric limits, stale provenance, and nothing written
on refusal."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opacus", reason="the shared run trains with DP ([privacy] extra)")

from release_fixtures import VERIFIER, approver, copy_run, policy, read_envelope, train_run  # noqa: E402

from securetrain.release.errors import ReleaseRefusedError  # noqa: E402
from securetrain.release.gate import approve, load_run, release  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tmp_path_factory.mktemp("gate"))


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    return copy_run(trained, tmp_path)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "approvers"
    return {name: approver(folder, name)[0] for name in ("alice", "bob", "carol", "mallory")}


def _events(run: Path, action: str) -> list[dict]:
    from securetrain.pipeline.runner import open_run_audit

    with open_run_audit(load_run(run)) as log:
        return [{"outcome": e.outcome, **e.details} for e in log.entries() if e.action == action]


def _refused(run: Path, out: Path, pol: Path) -> list[str]:
    with pytest.raises(ReleaseRefusedError) as info:
        release(run, out, policy_path=pol)
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())  # no temp file left either
    return info.value.failures


def test_refused_without_approvals_and_nothing_written(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    pol = policy(keys["alice"].parent, ["alice", "bob", "carol"])
    out = tmp_path / "deploy" / "model.safetensors"
    failures = _refused(run, out, pol)
    assert failures == ["approvals: 0 of 2 required from distinct named approvers"]
    refused = _events(run, "release.refused")
    assert refused and refused[-1]["outcome"] == "denied" and refused[-1]["failures"] == failures


def test_accepted_with_k_valid_approvals(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    pol = policy(keys["alice"].parent, ["alice", "bob", "carol"])
    out = tmp_path / "deploy" / "model.safetensors"
    approve(run, keys["alice"], policy_path=pol)
    approve(run, keys["alice"], policy_path=pol)  # the same approver twice counts once
    approve(run, keys["mallory"], policy_path=pol)  # not in the policy: does not count
    failures = _refused(run, out, pol)
    assert len(failures) == 1 and "1 of 2" in failures[0] and "valid: alice" in failures[0]
    assert "1 by keys not in the policy" in failures[0]
    approve(run, keys["carol"], policy_path=pol)
    result = release(run, out, policy_path=pol)
    assert result["approvers"] == ["alice", "carol"]
    _, st = read_envelope(run)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == st["subject"][0]["digest"]["sha256"] == result["model_sha256"]
    assert out.stat().st_mode & 0o077 == 0
    from safetensors.torch import load_file

    assert load_file(out)  # a plain, loadable safetensors model
    exported = _events(run, "release.export")
    assert exported[-1]["model_sha256"] == result["model_sha256"] and exported[-1]["approvers"] == ["alice", "carol"]
    # The released file verifies against the provenance offline.
    rel = run / "release"
    proc = subprocess.run([sys.executable, "-I", str(VERIFIER), str(rel / "provenance.dsse.json"), "--public-key",
                           str(rel / "provenance-public-key.pem"), "--model", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # A second export never overwrites.
    with pytest.raises(ReleaseRefusedError, match="already exists"):
        release(run, out, policy_path=pol)


def test_forged_approval_does_not_count(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    """An approval event naming bob's key id but signed by someone else is rejected."""
    import base64

    from securetrain.pipeline.runner import open_run_audit
    from securetrain.release.provenance import key_id

    pol = policy(keys["alice"].parent, ["alice", "bob"], required=2)
    approve(run, keys["alice"], policy_path=pol)
    from cryptography.hazmat.primitives import serialization

    bob_pub = serialization.load_pem_public_key((keys["bob"].parent / "bob.pub.pem").read_bytes())
    _, st = read_envelope(run)
    digest = _events(run, "release.approve")[0]["statement_sha256"]
    with open_run_audit(load_run(run)) as log:
        log.record("release.approve", "run:fin", details={
            "statement_sha256": digest, "approver_keyid": key_id(bob_pub), "approver": "bob",
            "signature": base64.b64encode(b"\x00" * 64).decode()})
    failures = _refused(run, tmp_path / "out" / "m.safetensors", pol)
    assert "1 with a bad signature" in failures[0]


def test_refused_with_stale_provenance(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    """Approvals cover one statement; a newer checkpoint (or a re-signed statement) makes them stale."""
    from securetrain.pipeline.runner import open_run_audit
    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.pipeline.stages import run_checkpoint_store

    pol = policy(keys["alice"].parent, ["alice", "bob"])
    approve(run, keys["alice"], policy_path=pol)
    approve(run, keys["bob"], policy_path=pol)
    config = load_run(run)
    with open_run_audit(config) as log:  # the model is retrained after approval: a newer best checkpoint
        store = run_checkpoint_store(config, load_run_secrets(config), log, best=True)
        latest = store.load()
        store.save(latest.info.step + 1, latest.tensors, latest.metadata)
    failures = _refused(run, tmp_path / "out" / "m.safetensors", pol)
    assert any(f.startswith("stale provenance") for f in failures), failures


def test_refused_when_statement_changed_after_approval(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    from release_fixtures import run_provenance_key, write_statement

    pol = policy(keys["alice"].parent, ["alice", "bob"])
    approve(run, keys["alice"], policy_path=pol)
    approve(run, keys["bob"], policy_path=pol)
    _, st = read_envelope(run)
    st["predicate"]["validation"]["best"]["value"] = 0.999
    write_statement(run, st, key=run_provenance_key(run))
    failures = _refused(run, tmp_path / "out" / "m.safetensors", pol)
    assert any("provenance.sign" in f for f in failures), failures
    assert any("2 for an older provenance" in f for f in failures), failures


def test_refused_with_epsilon_over_limit_and_low_metric_naming_each(run: Path, keys: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    pol = policy(keys["alice"].parent, ["alice"], required=1, max_epsilon=1.0, min_auc=0.999)
    approve(run, keys["alice"], policy_path=pol)
    failures = _refused(run, tmp_path / "out" / "m.safetensors", pol)
    assert len(failures) == 2, failures
    assert failures[0].startswith("privacy: ε = ") and "exceeds the policy's max_epsilon 1.0" in failures[0]
    assert failures[1].startswith("validation: auc = ") and ">= 0.999" in failures[1]


def test_refused_when_model_container_tampered(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    pol = policy(keys["alice"].parent, ["alice"], required=1)
    approve(run, keys["alice"], policy_path=pol)
    _, st = read_envelope(run)
    container = run / "checkpoints" / "best" / st["subject"][1]["name"]
    data = bytearray(container.read_bytes())
    data[-10] ^= 1
    container.write_bytes(bytes(data))
    failures = _refused(run, tmp_path / "out" / "m.safetensors", pol)
    assert any(f.startswith("model: the encrypted container") for f in failures), failures


def test_cli_approve_and_export(run: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    pol = policy(keys["alice"].parent, ["alice", "bob"], required=1)
    out = tmp_path / "out" / "model.safetensors"
    runner = CliRunner()
    refused = runner.invoke(app, ["release", "export", str(run), str(out), "--policy", str(pol)])
    assert refused.exit_code == 1 and "approvals: 0 of 1" in refused.output and not out.exists()
    ok = runner.invoke(app, ["release", "approve", str(run), "--key", str(keys["bob"]), "--policy", str(pol)])
    assert ok.exit_code == 0 and "as bob" in ok.output, ok.output
    done = runner.invoke(app, ["release", "export", str(run), str(out), "--policy", str(pol)])
    assert done.exit_code == 0 and out.is_file(), done.output


def test_shipped_policy_fails_closed(run: Path, tmp_path: Path) -> None:
    """policies/release.yaml names no approvers: nothing is released until an operator names them."""
    out = tmp_path / "out" / "m.safetensors"
    failures = _refused(run, out, Path(__file__).resolve().parents[2] / "policies" / "release.yaml")
    assert any(f.startswith("approvals: 0 of 2") for f in failures)
    assert json.loads((run / "result.json").read_text())["training"]["privacy"]["epsilon"] <= 8.0


def test_release_step_waits_for_approvals_but_not_for_other_failures(run: Path, keys: dict[str, Path]) -> None:
    from securetrain.release.gate import release_step

    config = load_run(run)
    pol = policy(keys["alice"].parent, ["alice"], required=1)
    waiting = release_step(config.model_copy(update={"release": config.release.model_copy(update={"policy": pol})}))
    assert waiting["status"] == "awaiting_approval" and waiting["failures"][0].startswith("approvals:")
    strict = policy(keys["alice"].parent, ["alice"], required=1, max_epsilon=0.5, file="strict.yaml")
    refused = release_step(config.model_copy(update={"release": config.release.model_copy(update={"policy": strict})}))
    assert refused["status"] == "refused" and any(f.startswith("privacy:") for f in refused["failures"])
    approve(run, keys["alice"], policy_path=pol)
    done = release_step(config.model_copy(update={"release": config.release.model_copy(update={"policy": pol})}))
    assert done["status"] == "released" and (run / "release" / "model.safetensors").is_file()

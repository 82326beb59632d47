"""One small DP finance run (no HE) shared by the provenance and release-gate tests."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ROOT = Path(__file__).resolve().parents[2]
VERIFIER = ROOT / "audit" / "verify_provenance.py"
EPSILON = 4.0


def train_run(tmp: Path) -> Path:
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    data = yaml.safe_load((ROOT / "examples" / "finance.yaml").read_text())
    data.update(name="fin", output_dir=str(tmp / "runs"), he={"enabled": False})
    data["data"].update(policy=str(ROOT / "policies" / "finance-pii.yaml"),
                        synthetic_table={"rows": 300, "customers": 60, "seed": 1})
    data["training"].update(epochs=2, batch_size=64, checkpoint_every=4, log_every=2, precision="fp32",
                            privacy={"target_epsilon": EPSILON, "delta": 1e-4})
    config = tmp / "fin.yaml"
    config.write_text(yaml.safe_dump(data))
    out = CliRunner().invoke(app, ["run", str(config), "--no-prefect"])
    assert out.exit_code == 0, out.output + repr(out.exception)
    return tmp / "runs" / "fin"


def copy_run(src: Path, tmp: Path) -> Path:
    dst = tmp / "copy" / "fin"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def verify_cli(run: Path, *extra: str, public_key: Path | None = None) -> subprocess.CompletedProcess[str]:
    rel = run / "release"
    cmd = [sys.executable, "-I", str(VERIFIER), str(rel / "provenance.dsse.json"),
           "--public-key", str(public_key or rel / "provenance-public-key.pem"),
           "--audit-export", str(run / "audit-export"), "--audit-public-key", str(run / "audit-public-key.pem"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def read_envelope(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    env = json.loads((run / "release" / "provenance.dsse.json").read_text())
    return env, json.loads(base64.b64decode(env["payload"]))


def write_statement(run: Path, statement: dict[str, Any], *, key: Ed25519PrivateKey | None = None) -> None:
    """Replace the statement; re-signed with ``key`` (e.g. the run's own provenance key) or left with the old signature."""
    from securetrain.release.provenance import canonical_json, sign_envelope

    env, _ = read_envelope(run)
    payload = canonical_json(statement)
    if key is not None:
        env = sign_envelope(payload, key)
    else:
        env["payload"] = base64.b64encode(payload).decode()
    (run / "release" / "provenance.dsse.json").write_text(json.dumps(env))


def run_provenance_key(run: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key((run / "keys" / "provenance-signing.pem").read_bytes(), password=None)
    assert isinstance(key, Ed25519PrivateKey)
    return key


def approver(folder: Path, name: str) -> tuple[Path, Path]:
    key = Ed25519PrivateKey.generate()
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def policy(folder: Path, approvers: list[str], *, required: int = 2, max_epsilon: float | None = 8.0,
           min_auc: float = 0.0, file: str = "release.yaml") -> Path:
    data = {"name": "test-release", "version": "7", "max_epsilon": max_epsilon,
            "min_validation": {"metric": "auc", "value": min_auc},
            "approvals": {"required": required,
                          "approvers": [{"name": n, "public_key": f"{n}.pub.pem"} for n in approvers]}}
    path = folder / file
    path.write_text(yaml.safe_dump(data))
    return path

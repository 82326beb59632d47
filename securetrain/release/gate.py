"""The release gate: ``policies/release.yaml`` conditions, signed approvals, and the atomic export.

- :func:`approve` appends a ``release.approve`` event to the run's audit log: the approver's Ed25519
  signature over :func:`approval_message` (the run name and the SHA-256 of the provenance
  statement), and the approver's key id. An approval is bound to one statement: re-signing the
  provenance (a retrained model, another checkpoint) makes every earlier approval stale.
- :func:`release` checks every condition, collects *all* failures, and either writes the decrypted
  model atomically (and records ``release.export``) or writes nothing, records ``release.refused``
  and raises :class:`ReleaseRefusedError` naming each failed condition.

Conditions (docs/release.md): provenance signature and statement; the audit log verifies and the
statement's checkpoint, run events and ``provenance.sign`` are in it (the stand-alone
``verify_provenance.py`` over a fresh export); the model container and the plaintext weights match
the statement's subjects and are the run's newest (no stale provenance); ε at most ``max_epsilon``;
the validation metric at least ``min_validation``; ``approvals.required`` valid approvals from
distinct approvers named in the policy.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import yaml
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from securetrain.io.atomic import atomic_write_bytes
from securetrain.release import provenance as prov
from securetrain.release.errors import ProvenanceError, ReleaseError, ReleasePolicyError, ReleaseRefusedError
from securetrain.training.config import lower_is_better

APPROVAL_CONTEXT = b"securetrain-release-approval/v1\n"


class Approver(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
    public_key: str = Field(description="PEM text, or a path to a PEM file (relative to the policy file).")


class Approvals(BaseModel):
    model_config = ConfigDict(extra="forbid")
    required: PositiveInt = 1
    approvers: list[Approver] = Field(default_factory=list)


class MinValidation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str = "auc"
    value: float
    mode: str = Field("auto", pattern="^(auto|min|max)$", description="max: higher is better (auto: min for *loss*).")


class ReleasePolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "release"
    version: str = "1"
    max_epsilon: float | None = Field(None, gt=0, description="None: DP not required; else ε must be <= this.")
    min_validation: MinValidation | None = None
    provenance_public_key: str | None = Field(None, description="Pin the provenance key (PEM or path); default: the run's.")
    audit_public_key: str | None = Field(None, description="Pin the audit key (PEM or path); default: the run's.")
    approvals: Approvals = Field(default_factory=Approvals)


def _pem(value: str, base: Path) -> bytes:
    if "-----BEGIN" in value:
        return value.encode()
    path = Path(value)
    path = path if path.is_absolute() else base / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ReleasePolicyError(f"cannot read public key {path}: {exc.strerror}") from None


def _public_key(pem: bytes, what: str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except ValueError:
        raise ReleasePolicyError(f"{what}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ReleasePolicyError(f"{what}: not an Ed25519 public key")
    return key


def load_policy(path: str | Path | None = None) -> tuple[ReleasePolicy, Path]:
    """The release policy (default: the shipped ``policies/release.yaml``) and its folder."""
    from securetrain.resources import resolve_policy

    file = resolve_policy(path or "release")
    try:
        data = yaml.safe_load(Path(file).read_text()) or {}
        return ReleasePolicy.model_validate(data), Path(file).resolve().parent
    except (OSError, yaml.YAMLError) as exc:
        raise ReleasePolicyError(f"cannot read release policy {file}: {exc}") from None
    except ValidationError as exc:
        raise ReleasePolicyError(f"invalid release policy {file}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


# --- the run ---------------------------------------------------------------------------
def load_run(run_dir: str | Path) -> Any:
    """The run's PipelineConfig from ``release/run-config.json`` (written with the provenance).

    A run directory that was moved keeps working when its name is the run's name: ``output_dir`` is
    re-based on its parent (explicitly configured absolute paths, e.g. ``audit.url``, are kept).
    """
    from securetrain.pipeline.config import PipelineConfig

    run_dir = Path(run_dir)
    file = prov.release_dir(run_dir) / prov.CONFIG_FILE
    try:
        config = PipelineConfig.model_validate_json(file.read_bytes())
        if run_dir.name == config.name and run_dir.resolve() != config.run_dir.resolve():
            # A moved/copied run directory: its defaults (audit.db, keys/, checkpoints/) moved with it.
            config = config.model_copy(update={"output_dir": run_dir.parent})
        return config
    except OSError:
        raise ReleaseError(f"{run_dir} has no signed provenance ({file} is missing)",
                           hint="run the pipeline with release.provenance: true") from None
    except ValidationError as exc:
        raise ProvenanceError(f"{file} is not a valid run configuration: {exc.errors()[0]['msg']}") from None


def approval_message(run_name: str, statement_sha256: str) -> bytes:
    return APPROVAL_CONTEXT + run_name.encode() + b"\n" + statement_sha256.encode()


def _load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ReleaseError(f"cannot load the approver key {path}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ReleaseError(f"{path} is not an Ed25519 private key")
    return key


def _statement(run_dir: Path, public_key: Ed25519PublicKey) -> tuple[dict[str, Any], str]:
    """The statement after checking its DSSE signature (the full check is in :func:`release`)."""
    vp = _verifier()
    try:
        statement, payload = vp.open_envelope(prov.release_dir(run_dir) / prov.ENVELOPE_FILE, public_key)
        vp.check_statement(statement)
    except vp.Failure as exc:
        raise ProvenanceError(f"provenance does not verify: {exc}") from None
    except OSError as exc:
        raise ProvenanceError(f"cannot read the provenance: {exc.strerror}") from None
    return statement, hashlib.sha256(payload).hexdigest()


def _verifier() -> Any:
    """The stand-alone ``verify_provenance`` module: the checkout's ``audit/`` next to this package
    (so a checkout never mixes in another tree's installed copy), else the installed package."""
    from securetrain.resources import find_project_file

    path = find_project_file("audit/verify_provenance.py", required=False)
    if path is None:
        return importlib.import_module("securetrain_audit_verify.verify_provenance")
    spec = importlib.util.spec_from_file_location("_securetrain_verify_provenance", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _provenance_key(run_dir: Path, policy: ReleasePolicy, base: Path) -> Ed25519PublicKey:
    if policy.provenance_public_key:
        return _public_key(_pem(policy.provenance_public_key, base), "provenance_public_key")
    return _public_key(_pem(str(prov.release_dir(run_dir) / prov.PUBLIC_KEY_FILE), Path("/")), "provenance key")


def approve(run_dir: str | Path, key_path: str | Path, *, policy_path: str | Path | None = None) -> dict[str, Any]:
    """Sign the run's current provenance with an approver key and append ``release.approve``."""
    from securetrain.pipeline.runner import open_run_audit

    run_dir = Path(run_dir)
    config = load_run(run_dir)
    policy, base = load_policy(policy_path or config.release.policy)
    statement, digest = _statement(run_dir, _provenance_key(run_dir, policy, base))
    key = _load_private_key(Path(key_path))
    kid = prov.key_id(key.public_key())
    signature = key.sign(approval_message(config.name, digest))
    names = _names_for(policy, base, kid)
    with open_run_audit(config) as log:
        log.record("release.approve", f"run:{config.name}", details={
            "statement_sha256": digest, "approver_keyid": kid, "approver": names[0] if names else None,
            "signature": base64.b64encode(signature).decode(), "model_sha256": statement["subject"][0]["digest"]["sha256"],
        })
    return {"statement_sha256": digest, "approver_keyid": kid, "approver": names[0] if names else None}


def _approvers(policy: ReleasePolicy, base: Path) -> dict[str, tuple[str, Ed25519PublicKey]]:
    """key id -> (name, key) of every approver the policy names."""
    out: dict[str, tuple[str, Ed25519PublicKey]] = {}
    for a in policy.approvals.approvers:
        key = _public_key(_pem(a.public_key, base), f"approver {a.name}")
        out[prov.key_id(key)] = (a.name, key)
    return out


def _names_for(policy: ReleasePolicy, base: Path, kid: str) -> list[str]:
    named = _approvers(policy, base).get(kid)
    return [named[0]] if named else []


# --- the conditions ----------------------------------------------------------------------
def _check_audit_and_statement(run_dir: Path, config: Any, policy: ReleasePolicy, base: Path, log: Any,
                               failures: list[str]) -> None:
    """The stand-alone verifier over a fresh export of the live log (kept in a private temp dir)."""
    vp = _verifier()
    with tempfile.TemporaryDirectory(prefix=".release-check-", dir=run_dir) as tmp:
        export = Path(tmp) / "audit-export"
        log.export(export)
        audit_key = Path(tmp) / "audit-public-key.pem"
        pem = _pem(policy.audit_public_key, base) if policy.audit_public_key else log.public_key_pem()
        audit_key.write_bytes(pem)
        prov_key = Path(tmp) / "provenance-public-key.pem"
        prov_key.write_bytes(_provenance_key(run_dir, policy, base).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        rel = prov.release_dir(run_dir)
        args = argparse.Namespace(provenance=str(rel / prov.ENVELOPE_FILE), public_key=str(prov_key),
                                  audit_export=str(export), audit_public_key=str(audit_key), model=None,
                                  data_manifest=str(rel / prov.FILES_FILE), data_dir=None, inclusion_proof=None, file=None)
        result = vp.verify(args)
    if not result["ok"]:
        failures.append(f"provenance/audit: {result['error']}")


def _model_bytes(run_dir: Path, config: Any, statement: dict[str, Any], failures: list[str]) -> bytes | None:
    """Decrypt the statement's container; refuse if it, or the plaintext, differs or is not the newest."""
    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.pipeline.stages import run_checkpoint_store

    model = statement["predicate"]["model"]
    secrets = load_run_secrets(config)
    store = run_checkpoint_store(config, secrets, None, best=model.get("checkpoint") == "best")
    latest = store.latest()
    container = statement["subject"][1]
    if latest is None or latest.path.name != container["name"]:
        failures.append(f"stale provenance: the run's newest {model.get('checkpoint')} checkpoint is "
                        f"{latest.path.name if latest else 'missing'}, the statement describes {container['name']}")
        return None
    if prov.sha256_file(latest.path) != container["digest"]["sha256"]:
        failures.append(f"model: the encrypted container {container['name']} differs from the statement's digest")
        return None
    try:
        loaded = store.load(latest)
    except Exception as exc:  # noqa: BLE001 - any decryption/authentication failure refuses the release
        failures.append(f"model: the container does not decrypt/authenticate ({type(exc).__name__})")
        return None
    try:  # the signed record of how a regression model's released weights give the target's units
        plain = prov.model_safetensors(loaded.tensors, model.get("releasedOutputs"))
    except ProvenanceError as exc:
        failures.append(f"model: {exc}")
        return None
    if hashlib.sha256(plain).hexdigest() != statement["subject"][0]["digest"]["sha256"]:
        failures.append("model: the decrypted weights differ from the statement's model.safetensors digest")
        return None
    return plain


def _check_privacy(policy: ReleasePolicy, statement: dict[str, Any], failures: list[str]) -> None:
    if policy.max_epsilon is None:
        return
    privacy = statement["predicate"].get("privacy")
    if not privacy or privacy.get("epsilon") is None:
        failures.append(f"privacy: the model was not trained with differential privacy (policy max ε {policy.max_epsilon})")
    elif float(privacy["epsilon"]) > policy.max_epsilon:
        failures.append(f"privacy: ε = {float(privacy['epsilon']):.4g} exceeds the policy's max_epsilon {policy.max_epsilon}")


def _check_metric(policy: ReleasePolicy, statement: dict[str, Any], failures: list[str]) -> None:
    want = policy.min_validation
    if want is None:
        return
    v = statement["predicate"].get("validation") or {}
    best, last = v.get("best") or {}, v.get("last") or {}
    value = best.get("value") if best.get("metric") == want.metric else last.get(want.metric)
    if statement["predicate"]["model"].get("checkpoint") == "last" and want.metric in last:
        value = last.get(want.metric)
    maximize = want.mode == "max" or (want.mode == "auto" and not lower_is_better(want.metric))
    if value is None:
        failures.append(f"validation: the statement has no {want.metric!r} metric")
    elif (float(value) < want.value) if maximize else (float(value) > want.value):
        sign = ">=" if maximize else "<="
        failures.append(f"validation: {want.metric} = {float(value):.4g}, the policy requires {sign} {want.value}")


def _check_approvals(policy: ReleasePolicy, base: Path, log: Any, run_name: str, digest: str,
                     failures: list[str]) -> list[str]:
    approvers = _approvers(policy, base)
    valid: set[str] = set()
    stale = bad = unknown = 0
    message = approval_message(run_name, digest)
    for e in log.entries():
        if e.action != "release.approve" or e.resource != f"run:{run_name}":
            continue
        d = e.details
        if d.get("statement_sha256") != digest:
            stale += 1
            continue
        named = approvers.get(str(d.get("approver_keyid")))
        if named is None:
            unknown += 1
            continue
        try:
            named[1].verify(base64.b64decode(str(d.get("signature", "")), validate=True), message)
        except (InvalidSignature, ValueError):
            bad += 1
            continue
        valid.add(named[0])
    need = policy.approvals.required
    if len(valid) < need:
        extra = [f"{n} for an older provenance" for n in [stale] if n] + \
                [f"{n} by keys not in the policy" for n in [unknown] if n] + \
                [f"{n} with a bad signature" for n in [bad] if n]
        failures.append(f"approvals: {len(valid)} of {need} required from distinct named approvers"
                        + (f" (valid: {', '.join(sorted(valid))})" if valid else "")
                        + (f"; ignored: {', '.join(extra)}" if extra else ""))
    return sorted(valid)


def release(run_dir: str | Path, out: str | Path, *, policy_path: str | Path | None = None) -> dict[str, Any]:
    """Write the deployable model to ``out`` iff every condition holds; else raise :class:`ReleaseRefusedError`."""
    from securetrain.pipeline.runner import open_run_audit

    run_dir, out = Path(run_dir), Path(out)
    config = load_run(run_dir)
    policy, base = load_policy(policy_path or config.release.policy)
    failures: list[str] = []
    with open_run_audit(config) as log:
        try:
            statement, digest = _statement(run_dir, _provenance_key(run_dir, policy, base))
        except ProvenanceError as exc:
            failures.append(f"provenance: {exc}")
            statement, digest = None, None
        approvers: list[str] = []
        plain = None
        if statement is not None and digest is not None:
            _check_audit_and_statement(run_dir, config, policy, base, log, failures)
            plain = _model_bytes(run_dir, config, statement, failures)
            _check_privacy(policy, statement, failures)
            _check_metric(policy, statement, failures)
            approvers = _check_approvals(policy, base, log, config.name, digest, failures)
        if out.exists():
            failures.append(f"output: {out} already exists (a release never overwrites)")
        if failures or plain is None:
            log.record("release.refused", f"run:{config.name}", outcome="denied", details={
                "statement_sha256": digest, "policy": policy.name, "policy_version": policy.version,
                "failures": failures})
            raise ReleaseRefusedError(failures or ["model: not available"])
        model_sha = hashlib.sha256(plain).hexdigest()
        atomic_write_bytes(out, plain, mode=0o600)
        log.record("release.export", f"run:{config.name}", details={
            "statement_sha256": digest, "model_sha256": model_sha, "output": out.name, "approvers": approvers,
            "policy": policy.name, "policy_version": policy.version, "bytes": len(plain)})
        log.checkpoint()
    return {"output": str(out), "model_sha256": model_sha, "statement_sha256": digest, "approvers": approvers}


def prove_file(run_dir: str | Path, path: str) -> dict[str, Any]:
    """Inclusion proof of one training file (``securetrain release prove``)."""
    import json

    manifest = json.loads((prov.release_dir(Path(run_dir)) / prov.FILES_FILE).read_text())
    return prov.inclusion_proof(manifest, path)


def release_step(config: Any) -> dict[str, Any]:
    """The pipeline's optional release step: ``released``, ``awaiting_approval`` (only approvals are
    missing: the Prefect flow suspends and retries after a resume) or ``refused`` (anything else)."""
    out = config.release.export_to or (prov.release_dir(config.run_dir) / prov.MODEL_NAME)
    try:
        return {"status": "released", **release(config.run_dir, out, policy_path=config.release.policy)}
    except ReleaseRefusedError as exc:
        waiting = all(f.startswith("approvals:") for f in exc.failures)
        return {"status": "awaiting_approval" if waiting else "refused", "failures": exc.failures}

"""Signed training provenance: an in-toto Statement v1 in a DSSE envelope, signed with Ed25519.

At the end of a pipeline run :func:`sign_run_provenance` writes ``<run_dir>/release/``:

- ``provenance.dsse.json``: the envelope (format: docs/provenance.md);
- ``provenance-public-key.pem``: the public half of the run's provenance key;
- ``training-files.json``: the (path, sha256) leaves of the training-data Merkle tree, so one file's
  inclusion can be proven later without revealing the others (:func:`inclusion_proof`);
- ``run-config.json``: the run's configuration exactly as digested (``config.sha256``), so the
  release commands can find the run's audit log and keys from the run directory alone.

Key: a dedicated Ed25519 key ``$SECURETRAIN_PROVENANCE_KEY`` or ``<secrets dir>/provenance-signing.pem`` (purpose
``securetrain-provenance``), separate from the audit log's signing key: compromising one does not
let an attacker forge the other. The statement names the audit checkpoint (tree size + root) that
covers the run; then a ``provenance.sign`` audit event records the statement's digest.

Verification is done by the stand-alone ``audit/verify_provenance.py`` (stdlib + cryptography).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from securetrain.audit.merkle import inclusion_proof as _merkle_path
from securetrain.audit.merkle import leaf_hash, root_hash
from securetrain.io.atomic import atomic_write_bytes
from securetrain.release.errors import ProvenanceError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://securetrain.dev/provenance/training/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
KEY_PURPOSE = "securetrain-provenance"
FILES_FORMAT = "securetrain-training-files/1"
MODEL_NAME = "model.safetensors"
RELEASE_DIR = "release"
ENVELOPE_FILE = "provenance.dsse.json"
PUBLIC_KEY_FILE = "provenance-public-key.pem"
FILES_FILE = "training-files.json"
CONFIG_FILE = "run-config.json"


# --- DSSE (https://github.com/secure-systems-lab/dsse/blob/master/protocol.md) ---------------
def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: ``"DSSEv1" SP len(type) SP type SP len(body) SP body``."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def key_id(public_key: Ed25519PublicKey) -> str:
    """Hex SHA-256 of the raw 32-byte Ed25519 public key (the DSSE ``keyid``)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def sign_envelope(payload: bytes, key: Ed25519PrivateKey, payload_type: str = PAYLOAD_TYPE) -> dict[str, Any]:
    sig = key.sign(pae(payload_type, payload))
    return {"payloadType": payload_type, "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": key_id(key.public_key()), "sig": base64.b64encode(sig).decode()}]}


def canonical_json(value: Any) -> bytes:
    """The statement's bytes: sorted keys, no insignificant whitespace, UTF-8 (signed as is)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def validate_statement(statement: Mapping[str, Any]) -> None:
    """Structural check with the in-toto-attestation library when it is installed."""
    try:
        from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
        from in_toto_attestation.v1.statement import Statement
    except ImportError:  # pragma: no cover - the [release] extra is optional for signing
        return
    subjects = [ResourceDescriptor(name=s["name"], digest=s["digest"]).pb for s in statement["subject"]]
    try:
        Statement(subjects, statement["predicateType"], {"run": statement["predicate"]["run"]}).validate()
    except ValueError as exc:
        raise ProvenanceError(f"the provenance statement is not a valid in-toto Statement v1: {exc}") from None


# --- the training-data Merkle tree -----------------------------------------------------
def file_leaf(path: str, sha256_hex: str) -> bytes:
    """Leaf *data* for one file: UTF-8 path, a newline, the 32-byte SHA-256 of its contents."""
    return path.encode() + b"\n" + bytes.fromhex(sha256_hex)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def digest_tree(folder: Path) -> list[dict[str, str]]:
    """``[{path, sha256}]`` for every regular file under ``folder``, sorted by UTF-8 path bytes."""
    files = sorted((p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()),
                   key=lambda p: p.relative_to(folder).as_posix().encode())
    return [{"path": p.relative_to(folder).as_posix(), "sha256": sha256_file(p)} for p in files]


def files_root(files: Sequence[Mapping[str, str]]) -> str:
    return root_hash([leaf_hash(file_leaf(f["path"], f["sha256"])) for f in files]).hex()


def inclusion_proof(manifest: Mapping[str, Any], path: str) -> dict[str, Any]:
    """RFC 6962 inclusion proof of one training file in the statement's ``trainingData.merkleRoot``."""
    files = manifest["files"]
    index = next((i for i, f in enumerate(files) if f["path"] == path), None)
    if index is None:
        raise ProvenanceError(f"{path!r} is not among the run's training files")
    leaves = [leaf_hash(file_leaf(f["path"], f["sha256"])) for f in files]
    return {"format": "securetrain-inclusion-proof/1", "path": path, "sha256": files[index]["sha256"],
            "index": index, "treeSize": len(files), "root": root_hash(leaves).hex(),
            "proof": [p.hex() for p in _merkle_path(index, leaves)]}


# --- model digests ---------------------------------------------------------------------
def model_safetensors(tensors: Mapping[str, Any], released: Mapping[str, Any] | None = None) -> bytes:
    """The deployable model: the checkpoint's ``model/`` tensors as a plain safetensors file; for a
    regression model trained on standardised targets, ``released`` (the statement's
    ``predicate.model.releasedOutputs``) says how they give the target's units
    (:mod:`securetrain.release.target_units`: folded into the output layer, or wrapped)."""
    from safetensors.torch import save

    from securetrain.release.target_units import released_tensors

    model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    if not model:
        raise ProvenanceError("the checkpoint holds no model tensors")
    return save({k: v.contiguous() for k, v in sorted(released_tensors(model, released).items())})


def released_outputs_record(config: Any, secrets: Any, which: str, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """How the released weights of the run's regression model (trained on standardised targets)
    predict the target's units: decided on the trained model (the ``which`` checkpoint, ``tensors``)
    and the first training samples (:func:`securetrain.release.target_units.released_outputs`)."""
    from torch.utils.data import DataLoader

    from securetrain.pipeline.stages import load_trained_model, task_datasets
    from securetrain.pipeline.target_scaling import load_target_scaling
    from securetrain.release.target_units import released_outputs
    from securetrain.training.batches import call_model, split_batch
    from securetrain.training.validation import primary_output

    scaling = load_target_scaling(config.run_dir)
    if scaling is None:
        raise ProvenanceError("the run trained on standardised targets but its target-scaling.json is missing",
                              hint="train the run again")
    _, data = task_datasets(config, secrets, None)
    model = load_trained_model(config, secrets, None, data, which=which)
    x = split_batch(next(iter(DataLoader(data.train, batch_size=64, shuffle=False))))[0]
    state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    return released_outputs(model, state, scaling.to_dict(), lambda m: primary_output(call_model(m, x)))


def source_commit() -> str | None:
    """``$SECURETRAIN_SOURCE_COMMIT``, else ``git rev-parse HEAD`` of the source tree, else None (one rule
    with the run report, without its ``-dirty`` marker)."""
    from securetrain.pipeline.runinfo import source_commit as run_source_commit

    return run_source_commit(mark_dirty=False)


# --- the run's statement -----------------------------------------------------------------
def release_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RELEASE_DIR


def signing_key_path(config: Any) -> Path:
    """``$SECURETRAIN_PROVENANCE_KEY`` (an Ed25519 PEM, 0600), else ``<secrets dir>/provenance-signing.pem``."""
    from securetrain.pipeline.secrets import keys_dir

    explicit = os.environ.get("SECURETRAIN_PROVENANCE_KEY")
    return Path(explicit) if explicit else keys_dir(config) / "provenance-signing.pem"


def _data_dir(config: Any, prepared: Any) -> Path | None:
    for summary in (getattr(prepared, "deid", None), getattr(prepared, "masking", None)):
        if summary is not None and Path(summary.output_dir).is_dir():
            return Path(summary.output_dir)
    folder = config.run_dir / "data"
    return folder if folder.is_dir() else None


def _model_checkpoint(config: Any, secrets: Any) -> tuple[str, Any]:
    from securetrain.pipeline.stages import run_checkpoint_store

    best = run_checkpoint_store(config, secrets, None, best=True)
    if best.latest() is not None:
        return "best", best
    return "last", run_checkpoint_store(config, secrets, None)


def sign_run_provenance(config: Any, audit_log: Any, prepared: Any, training: Any, secrets: Any) -> dict[str, Any]:
    """Build, sign and write the run's provenance (see the module docstring); returns a summary."""
    import securetrain
    from securetrain.audit.keys import load_signing_key
    from securetrain.pipeline.runner import config_digest

    out = release_dir(config.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    which, store = _model_checkpoint(config, secrets)
    info = store.latest()
    if info is None:
        raise ProvenanceError("the run has no checkpoint to describe", hint="train with checkpoint_at_end: true")
    loaded = store.load(info)
    # A regression model trained on standardised targets is released predicting the target's units.
    released = (released_outputs_record(config, secrets, which, loaded.tensors) if training.target_scaling
                else None)
    plain = model_safetensors(loaded.tensors, released)
    data_dir = _data_dir(config, prepared)
    files = digest_tree(data_dir) if data_dir is not None else []
    manifest = {"format": FILES_FORMAT, "root": files_root(files), "files": files}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"
    config_bytes = config.model_dump_json().encode()
    digest = config_digest(config)
    if hashlib.sha256(config_bytes).hexdigest() != digest:  # pragma: no cover - guards a refactor of config_digest
        raise ProvenanceError("config digest does not match the serialised config")
    policy = Path(config.data.policy) if getattr(config.data, "policy", None) else None
    cp = audit_log.checkpoint()  # signs the head that covers every event of the run so far
    key = load_signing_key(signing_key_path(config))  # created by `release keygen` or the demo's set-up
    validation = list(training.validation or [])
    statement: dict[str, Any] = {
        "_type": STATEMENT_TYPE,
        "subject": [
            {"name": MODEL_NAME, "digest": {"sha256": hashlib.sha256(plain).hexdigest()}},
            {"name": info.path.name, "digest": {"sha256": info.sha256}},
        ],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "run": {"name": config.name, "resource": f"run:{config.name}", "task": getattr(prepared, "task", None)},
            "model": {"checkpoint": which, "step": info.step, "container": info.path.name, "keyId": info.key_id,
                      "target": training.model_target, "parameters": training.parameters,
                      # a regression model trained on standardised targets: prediction = output * std + mean,
                      # and how the released model.safetensors predicts in the target's units
                      **({"targetScaling": training.target_scaling} if training.target_scaling else {}),
                      **({"releasedOutputs": released} if released else {})},
            "trainingData": {"tree": "rfc6962-sha256", "leaf": "utf8(path) || 0x0A || sha256(file)",
                             "merkleRoot": manifest["root"], "leafCount": len(files),
                             "manifest": FILES_FILE, "manifestSha256": hashlib.sha256(manifest_bytes).hexdigest()},
            "maskingPolicy": ({"name": policy.name, "sha256": sha256_file(policy)} if policy and policy.is_file()
                              else None),
            "config": {"sha256": digest, "file": CONFIG_FILE},
            "software": {"name": "securetrain", "version": securetrain.__version__, "sourceCommit": source_commit()},
            "device": {"device": training.device, "worldSize": int(os.environ.get("WORLD_SIZE", "1"))},
            "privacy": training.privacy,
            "validation": {"best": {k: v for k, v in training.best.items() if k != "checkpoint"} if training.best else None,
                           "last": validation[-1] if validation else None},
            "audit": {"origin": cp.origin, "treeSize": cp.tree_size, "rootHash": cp.root_hash.hex()},
            "signer": {"keyid": key_id(key.public_key()), "purpose": KEY_PURPOSE},
        },
    }
    validate_statement(statement)
    payload = canonical_json(statement)
    envelope = sign_envelope(payload, key)
    atomic_write_bytes(out / FILES_FILE, manifest_bytes, mode=0o644)
    atomic_write_bytes(out / CONFIG_FILE, config_bytes, mode=0o644)
    atomic_write_bytes(out / PUBLIC_KEY_FILE, key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo), mode=0o644)
    atomic_write_bytes(out / ENVELOPE_FILE, json.dumps(envelope, indent=1).encode() + b"\n", mode=0o644)
    statement_sha256 = hashlib.sha256(payload).hexdigest()
    audit_log.record("provenance.sign", f"run:{config.name}", details={
        "statement_sha256": statement_sha256, "model_sha256": statement["subject"][0]["digest"]["sha256"],
        "container_sha256": info.sha256, "audit_tree_size": cp.tree_size, "keyid": key_id(key.public_key()),
        "training_files": len(files), "training_files_root": manifest["root"],
    })
    return {"path": str(out / ENVELOPE_FILE), "statement_sha256": statement_sha256,
            "model_sha256": statement["subject"][0]["digest"]["sha256"], "container_sha256": info.sha256,
            "audit_tree_size": cp.tree_size, "keyid": key_id(key.public_key())}


def read_statement(envelope_path: Path) -> tuple[dict[str, Any], bytes]:
    """The (unverified) statement and its payload bytes; verification is ``verify_provenance``'s job."""
    try:
        envelope = json.loads(Path(envelope_path).read_text())
        payload = base64.b64decode(envelope["payload"], validate=True)
        return json.loads(payload), payload
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ProvenanceError(f"cannot read the provenance envelope {envelope_path}: {exc}") from None

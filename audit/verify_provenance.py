#!/usr/bin/env python3
"""Standalone verifier for securetrain training provenance (in-toto Statement v1 in a DSSE envelope).

Needs only Python >= 3.11 and the ``cryptography`` package; it imports nothing from securetrain.
The audit export is checked by ``verify_audit.py`` (its ``verify`` function), which sits next to
this file (or in the installed package ``securetrain_audit_verify``). Usage::

    python verify_provenance.py RUN_DIR/release/provenance.dsse.json --public-key provenance-public-key.pem \
        --audit-export RUN_DIR/audit-export --audit-public-key audit-public-key.pem \
        [--model model.safetensors | encrypted container] [--data-manifest training-files.json] \
        [--data-dir DIR] [--inclusion-proof proof.json [--file FILE]] [--json]

Exit status: 0 verified, 1 verification failed (the reason is printed), 2 usage or I/O error.
The format is specified in docs/provenance.md.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://securetrain.dev/provenance/training/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
KEY_PURPOSE = "securetrain-provenance"
MODEL_NAME = "model.safetensors"
EM_DASH = "\u2014"


class Failure(Exception):
    pass


def _verify_audit_module():
    """``verify_audit.py`` from this file's own folder (the checkout's audit/ or the installed package)."""
    path = Path(__file__).resolve().parent / "verify_audit.py"
    spec = importlib.util.spec_from_file_location("_securetrain_verify_audit", path)
    if spec is None or spec.loader is None:
        raise Failure(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- RFC 6962 Merkle tree (same definitions as verify_audit.py) ---------------------------
def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def merkle_root(leaves: list[bytes]) -> bytes:
    """Merkle Tree Hash (RFC 6962 2.1) of a list of leaf hashes."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return node_hash(merkle_root(leaves[:k]), merkle_root(leaves[k:]))


def root_from_inclusion_proof(index: int, size: int, leaf: bytes, proof: list[bytes]) -> bytes | None:
    """RFC 9162 2.1.3.2."""
    if not 0 <= index < size:
        return None
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return r if sn == 0 else None


def file_leaf(path: str, sha256_hex: str) -> bytes:
    return path.encode() + b"\n" + bytes.fromhex(sha256_hex)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def load_public_key(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise Failure(f"{path}: not an Ed25519 public key")
    return key


def key_id(key: Ed25519PublicKey) -> str:
    return hashlib.sha256(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).hexdigest()


# ---- the checks ---------------------------------------------------------------------------
def open_envelope(path: Path, key: Ed25519PublicKey) -> tuple[dict, bytes]:
    try:
        envelope = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError:
        raise Failure("envelope: not valid JSON") from None
    if not isinstance(envelope, dict) or envelope.get("payloadType") != PAYLOAD_TYPE:
        raise Failure(f"envelope: payloadType must be {PAYLOAD_TYPE}")
    try:
        payload = base64.b64decode(envelope["payload"], validate=True)
    except (KeyError, TypeError, binascii.Error):
        raise Failure("envelope: payload is missing or not base64") from None
    sigs = envelope.get("signatures")
    if not isinstance(sigs, list) or not sigs:
        raise Failure("envelope: no signatures")
    kid, verified = key_id(key), False
    for sig in sigs:
        if not isinstance(sig, dict) or sig.get("keyid") != kid:
            continue
        try:
            key.verify(base64.b64decode(sig.get("sig", ""), validate=True), pae(PAYLOAD_TYPE, payload))
        except (InvalidSignature, binascii.Error, TypeError):
            raise Failure("envelope: signature does not verify (statement edited, or signed by another key)") from None
        verified = True
    if not verified:
        raise Failure("envelope: not signed by the trusted provenance key")
    try:
        statement = json.loads(payload)
    except ValueError:
        raise Failure("statement: payload is not JSON") from None
    return statement, payload


def check_statement(st: dict) -> None:
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE:
        raise Failure(f"statement: _type must be {STATEMENT_TYPE}")
    if st.get("predicateType") != PREDICATE_TYPE:
        raise Failure(f"statement: predicateType must be {PREDICATE_TYPE}")
    subject = st.get("subject")
    if not isinstance(subject, list) or len(subject) != 2 or subject[0].get("name") != MODEL_NAME:
        raise Failure(f"statement: subject must be [{MODEL_NAME}, encrypted container]")
    for s in subject:
        d = s.get("digest", {}).get("sha256", "") if isinstance(s, dict) else ""
        if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
            raise Failure("statement: every subject needs a lowercase hex sha256 digest")
    p = st.get("predicate")
    needed = ("run", "model", "trainingData", "config", "software", "device", "privacy", "validation", "audit", "signer")
    if not isinstance(p, dict) or any(k not in p for k in needed):
        raise Failure(f"statement: predicate must have {', '.join(needed)}")
    if p["signer"].get("purpose") != KEY_PURPOSE:
        raise Failure(f"statement: signer purpose must be {KEY_PURPOSE}")


def split_notes(blob: str) -> list[str]:
    """Concatenated signed notes -> one string per note (same rule as verify_audit.py)."""
    notes, cur, in_sigs = [], [], False
    for line in blob.splitlines(keepends=True):
        if in_sigs and not line.startswith(EM_DASH + " "):
            notes.append("".join(cur))
            cur, in_sigs = [], False
        cur.append(line)
        if line == "\n":
            in_sigs = True
    if cur:
        notes.append("".join(cur))
    return [n for n in notes if n.strip()]


def _notes(text: str) -> list[tuple[str, int, str]]:
    """(origin, size, root hex) of each stored checkpoint (signatures were checked by verify_audit)."""
    out = []
    for note in split_notes(text):
        body = note[: note.rfind("\n\n") + 1].split("\n")
        out.append((body[0], int(body[1]), base64.b64decode(body[2]).hex()))
    return out


class _Args(argparse.Namespace):
    """verify_audit's options; any option this file does not set reads as None (its parser's default)."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def check_audit(st: dict, payload: bytes, export: Path, audit_key: Path | None, checks: list[str]) -> None:
    va = _verify_audit_module()
    ns = _Args(export=str(export), vkey=None, public_key=str(audit_key) if audit_key else None,
               trusted_checkpoint=[], html=None, json=False)
    result = va.verify(ns)
    if not result.get("ok"):
        raise Failure(f"audit export does not verify: {result.get('error')}")
    checks.append(f"audit export verifies ({result['entries']} entries, root {result['root_hash']})")
    a, p = st["predicate"]["audit"], st["predicate"]
    size, root = a.get("treeSize"), a.get("rootHash")
    if not isinstance(size, int) or size <= 0:
        raise Failure("statement: audit.treeSize must be a positive integer")
    stored = _notes((export / "checkpoints.note").read_text(encoding="utf-8"))
    if (a.get("origin"), size, root) not in stored:
        raise Failure(f"audit checkpoint {size}/{str(root)[:16]}... named by the statement is not a signed checkpoint "
                      "of this log (log rewritten, or statement edited)")
    lines = (export / "entries.jsonl").read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    entries = [json.loads(raw) for raw in lines]
    if merkle_root([leaf_hash(raw) for raw in lines[:size]]).hex() != root:
        raise Failure("audit: the first treeSize entries do not hash to the statement's rootHash")
    checks.append(f"the statement's audit checkpoint (size {size}) is signed and matches the log")
    run = p["run"]
    covered = entries[:size]
    start = [e for e in covered if e["action"] == "pipeline.start" and e["resource"] == run.get("resource")]
    if not start or start[-1]["details"].get("config_sha256") != p["config"].get("sha256"):
        raise Failure("audit: no pipeline.start for this run with the statement's config digest before the checkpoint")
    if not any(e["action"] == "training.stop" and e["resource"] == run.get("name") and e["outcome"] == "success"
               for e in covered):
        raise Failure("audit: the run's successful training.stop is not covered by the statement's checkpoint")
    container = st["subject"][1]
    if not any(e["action"] == "checkpoint.write" and e["resource"] == container["name"] and e["outcome"] == "success"
               and e["details"].get("sha256") == container["digest"]["sha256"] for e in covered):
        raise Failure("audit: no checkpoint.write of the model container with its digest before the checkpoint")
    checks.append("the covered log holds the run's pipeline.start (config digest), training.stop and the model's checkpoint.write")
    digest = hashlib.sha256(payload).hexdigest()
    if not any(e["action"] == "provenance.sign" and e["details"].get("statement_sha256") == digest for e in entries[size:]):
        raise Failure("audit: no provenance.sign event records this statement's digest (statement replaced?)")
    checks.append("a later provenance.sign event records this statement's digest")


def check_model(st: dict, model: Path, checks: list[str]) -> None:
    digest = sha256_file(model)
    for s in st["subject"]:
        if s["digest"]["sha256"] == digest:
            checks.append(f"model file matches subject {s['name']}")
            return
    raise Failure(f"model file {model.name}: sha256 {digest[:16]}... matches no subject (model altered or another model)")


def check_data(st: dict, manifest_path: Path, data_dir: Path | None, checks: list[str]) -> list[dict]:
    td = st["predicate"]["trainingData"]
    raw = manifest_path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != td.get("manifestSha256"):
        raise Failure("training-files manifest: sha256 differs from the statement's manifestSha256")
    files = json.loads(raw)["files"]
    root = merkle_root([leaf_hash(file_leaf(f["path"], f["sha256"])) for f in files]).hex()
    if root != td.get("merkleRoot") or len(files) != td.get("leafCount"):
        raise Failure("training-files manifest: Merkle root or leaf count differs from the statement")
    checks.append(f"training-data Merkle root over {len(files)} files matches")
    if data_dir is not None:
        for f in files:
            if sha256_file(data_dir / f["path"]) != f["sha256"]:
                raise Failure(f"training file {f['path']}: contents differ from the recorded digest")
        checks.append(f"all {len(files)} training files in {data_dir} match their digests")
    return files


def check_inclusion(st: dict, proof_path: Path, file: Path | None, checks: list[str]) -> None:
    td = st["predicate"]["trainingData"]
    proof = json.loads(Path(proof_path).read_text())
    digest = proof["sha256"]
    if file is not None and sha256_file(file) != digest:
        raise Failure(f"inclusion: {file} does not have the digest the proof is about")
    leaf = leaf_hash(file_leaf(proof["path"], digest))
    got = root_from_inclusion_proof(int(proof["index"]), int(proof["treeSize"]), leaf,
                                    [bytes.fromhex(h) for h in proof["proof"]])
    if got is None or got.hex() != td.get("merkleRoot") or proof["treeSize"] != td.get("leafCount"):
        raise Failure(f"inclusion: {proof['path']} is not proven to be in the training data")
    checks.append(f"training file {proof['path']} is included (RFC 6962 proof, {len(proof['proof'])} hashes)")


def verify(args: argparse.Namespace) -> dict:
    checks: list[str] = []
    result: dict = {"ok": False, "error": None, "checks": checks, "statement": None}
    try:
        statement, payload = open_envelope(Path(args.provenance), load_public_key(Path(args.public_key)))
        checks.append("DSSE signature verifies (Ed25519, provenance key)")
        check_statement(statement)
        checks.append("in-toto Statement v1 with the securetrain training predicate")
        result["statement"] = statement
        result["statement_sha256"] = hashlib.sha256(payload).hexdigest()
        if args.audit_export:
            check_audit(statement, payload, Path(args.audit_export),
                        Path(args.audit_public_key) if args.audit_public_key else None, checks)
        if args.model:
            check_model(statement, Path(args.model), checks)
        if args.data_manifest:
            check_data(statement, Path(args.data_manifest), Path(args.data_dir) if args.data_dir else None, checks)
        if args.inclusion_proof:
            check_inclusion(statement, Path(args.inclusion_proof), Path(args.file) if args.file else None, checks)
        result["ok"] = True
    except Failure as exc:
        result["error"] = str(exc)
    except (OSError, KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        result.update(error=f"cannot read input: {type(exc).__name__}: {exc}", io_error=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Verify securetrain training provenance offline.")
    parser.add_argument("provenance", help="provenance.dsse.json")
    parser.add_argument("--public-key", required=True, help="trusted provenance public key (PEM, Ed25519)")
    parser.add_argument("--audit-export", help="audit export directory (securetrain audit export)")
    parser.add_argument("--audit-public-key", help="trusted audit public key (PEM); default: the export's own")
    parser.add_argument("--model", help="model file: the released model.safetensors or the encrypted container")
    parser.add_argument("--data-manifest", help="training-files.json written with the provenance")
    parser.add_argument("--data-dir", help="also re-hash every training file under this directory")
    parser.add_argument("--inclusion-proof", help="inclusion proof of one training file (securetrain release prove)")
    parser.add_argument("--file", help="the training file the inclusion proof is about")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = verify(args)
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["ok"]:
        print("OK: provenance verified")
        for c in checks_of(result):
            print(f"  - {c}")
    else:
        print(f"FAILED: {result['error']}", file=sys.stderr)
    if result["ok"]:
        return 0
    return 2 if result.get("io_error") else 1


def checks_of(result: dict) -> list[str]:
    return list(result.get("checks", []))


if __name__ == "__main__":
    sys.exit(main())

"""The worked example in docs/audit-format.md ("Test vector") is what the code produces.

The block is regenerated here from the writer's own functions (entry bytes, entry hash, Merkle
tree, proofs, signed checkpoint, verifier key) and must appear in the page verbatim, so the page
cannot drift from the code; an independent verifier can be checked against it.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from securetrain.audit import canonical, merkle
from securetrain.audit.note import key_id, sign_checkpoint, verifier_key

DOC = Path(__file__).resolve().parents[2] / "docs" / "audit-format.md"
ORIGIN = "example.test/audit"
KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
EVENTS = [
    {"actor": "alice", "action": "dataset.read", "resource": "dataset:ct-2024", "outcome": "success",
     "details": {"rows": 12}},
    {"actor": "alice", "action": "train.epoch", "resource": "run:demo", "outcome": "success",
     # a float is stored as its repr string; non-ASCII stays literal, controls are escaped
     "details": {"loss": 0.30000000000000004, "note": "Zürich\t\u0001"}},
    {"actor": "svc-train", "action": "checkpoint.write", "resource": "step-000000000010.stenc",
     "outcome": "failure", "details": {}, "server_view": {"addr": None, "role": "writer",
                                                          "time": "2024-05-01T12:00:02.000500Z"}},
]


def vector_block() -> str:
    lines, leaves, prev = [], [], "0" * 64
    for seq, ev in enumerate(EVENTS):
        details = canonical.validate_details(ev["details"])
        obj = canonical.entry_object(
            seq=seq, ts=f"2024-05-01T12:00:0{seq}.000001Z", actor=ev["actor"], hostname="host-1",
            mac="02:00:00:00:00:01", action=ev["action"], resource=ev["resource"], outcome=ev["outcome"],
            details=details, prev_hash=prev, server_view=ev.get("server_view"))
        data = canonical.canonical_bytes(obj)
        prev = canonical.sha256_hex(data)
        leaves.append(merkle.leaf_hash(data))
        lines += [f"entry {seq} bytes      {data.decode()}", f"entry {seq} entry_hash {prev}",
                  f"entry {seq} leaf       {leaves[-1].hex()}"]
    root2, root3 = merkle.root_hash(leaves[:2]), merkle.root_hash(leaves)
    cp = sign_checkpoint(ORIGIN, 3, root3, ORIGIN, KEY)
    lines += [
        f"MTH(first 2)       {root2.hex()}",
        f"MTH(all 3)         {root3.hex()}",
        f"inclusion seq 1    {' '.join(h.hex() for h in merkle.inclusion_proof(1, leaves))}",
        f"consistency 2 -> 3 {' '.join(h.hex() for h in merkle.consistency_proof(2, leaves))}",
        f"key ID             {key_id(ORIGIN, KEY.public_key()).hex()}",
        f"verifier key       {verifier_key(ORIGIN, KEY.public_key())}",
        "checkpoint note (each line ends with LF):",
        *cp.note.splitlines(),
    ]
    return "\n".join(lines)


def test_docs_test_vector_matches_the_code() -> None:
    block = vector_block()
    assert block in DOC.read_text(encoding="utf-8"), "regenerate the block:\n" + block


def test_docs_test_vector_proofs_verify() -> None:
    """The page's proofs check out (RFC 9162 verification) against the page's roots."""
    rows = {line[:19].strip(): line[19:] for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith(("MTH(", "inclusion seq 1", "consistency 2 -> 3", "entry 1 leaf"))}
    root2, root3 = bytes.fromhex(rows["MTH(first 2)"]), bytes.fromhex(rows["MTH(all 3)"])
    inclusion = [bytes.fromhex(h) for h in rows["inclusion seq 1"].split()]
    consistency = [bytes.fromhex(h) for h in rows["consistency 2 -> 3"].split()]
    assert merkle.verify_inclusion(1, 3, bytes.fromhex(rows["entry 1 leaf"]), inclusion, root3)
    assert merkle.verify_consistency(2, 3, consistency, root2, root3)


def _standalone():  # noqa: ANN202
    import importlib.util

    spec = importlib.util.spec_from_file_location("verify_audit_docs", DOC.parents[1] / "audit" / "verify_audit.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_checkpoint_note_parsing_rules_of_the_page_hold_in_both_verifiers() -> None:
    """The page's "Checkpoints": extension lines after the root are accepted; a control character other than LF
    makes the note malformed; the signature lines follow the last blank line."""
    from securetrain.audit.errors import AuditIntegrityError
    from securetrain.audit.handover import build_chain, open_with_chain
    from securetrain.audit.note import sign_note

    standalone, chain = _standalone(), build_chain([KEY.public_key()], [])
    root = merkle.root_hash([])
    body = f"{ORIGIN}\n0\n{base64.b64encode(root).decode()}\n"
    extended = sign_note(body + "extension line\n", ORIGIN, KEY)
    assert open_with_chain(extended, chain) == (ORIGIN, 0, root)
    assert standalone.open_checkpoint(extended, KEY.public_key(), "note") == (ORIGIN, 0, root)
    tabbed = sign_note(body + "a\tb\n", ORIGIN, KEY)
    with pytest.raises(AuditIntegrityError, match="control"):
        open_with_chain(tabbed, chain)
    with pytest.raises(standalone.Failure, match="malformed"):
        standalone.open_checkpoint(tabbed, KEY.public_key(), "note")

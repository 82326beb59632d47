"""Audit-key rotation with a signed hand-over note (issue 10).

Every attack below was written to fail first: a hand-over signed only by the new key, a forged or
altered hand-over, a checkpoint by an unknown key, a checkpoint by the retired key after the
hand-over size, a rotation to the same key, a second hand-over from a retired key. Each is refused
by the library verifier, ``securetrain audit verify`` and the standalone ``audit/verify_audit.py``.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from conftest import POSTGRES_URL

from securetrain.audit import canonical
from securetrain.audit.anchors import FileAnchor
from securetrain.audit.errors import AuditConfigError, AuditIntegrityError
from securetrain.audit.export import verify_export
from securetrain.audit.handover import HANDOVER_HEADER, ROTATION_ACTION, handover_body, open_handover
from securetrain.audit.keys import create_signing_key, public_key_pem
from securetrain.audit.log import AuditLog
from securetrain.audit.note import EM_DASH, key_id, sign_checkpoint, sign_note, split_notes, verifier_key
from securetrain.cli.main import app

REPO = Path(__file__).resolve().parents[2]
VERIFIER = REPO / "audit" / "verify_audit.py"


@dataclass
class Rotated:
    log: AuditLog
    old: Ed25519PrivateKey
    new: Ed25519PrivateKey
    old_pem: Path
    new_pem: Path
    export: Path
    anchor: Path
    handover_size: int

    @property
    def origin(self) -> str:
        return self.log.origin

    def vkey(self, key: Ed25519PrivateKey) -> str:
        return verifier_key(self.origin, key.public_key())


@pytest.fixture
def rotated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rotated:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "data"))
    old_path, new_path = tmp_path / "old.pem", tmp_path / "new.pem"
    old, new = create_signing_key(old_path), create_signing_key(new_path)
    anchor = tmp_path / "anchors.notes"
    log = AuditLog(tmp_path / "audit.db", actor="alice", signing_key=old_path, checkpoint_every=4,
                   anchors=[FileAnchor(anchor)])
    for i in range(6):
        log.record("dataset.read", f"dataset:{i}", details={"rows": i})
    handover = log.rotate_key(new_path)
    for i in range(6, 11):
        log.record("dataset.read", f"dataset:{i}", details={"rows": i})
    out = log.export(tmp_path / "export")
    (tmp_path / "old.pub.pem").write_bytes(public_key_pem(old.public_key()))
    (tmp_path / "new.pub.pem").write_bytes(public_key_pem(new.public_key()))
    yield Rotated(log, old, new, tmp_path / "old.pub.pem", tmp_path / "new.pub.pem", out, anchor, handover.tree_size)
    log.close()


def standalone(export: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", str(VERIFIER), str(export), *args],
                          capture_output=True, text=True, timeout=120)


def cli(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, ["audit", *args])


def flat(text: str) -> str:
    return " ".join(text.split())


def _refresh_manifest(out: Path, *names: str) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    for name in names:
        manifest["files"][name] = canonical.sha256_hex((out / name).read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest))


def _root_at(log: AuditLog, size: int) -> bytes:
    return bytes.fromhex(log.consistency_proof(size, size)["new_root"])


def _all_refuse(r: Rotated, *, pinned: tuple[Ed25519PrivateKey, ...] | None = None, match: str) -> None:
    """The library, the CLI and the standalone verifier all refuse the export (exit 1), naming ``match``."""
    keys = pinned or (r.old,)
    report = verify_export(r.export, public_key=[k.public_key() for k in keys])
    assert not report.ok and match in str(report.error), report.error
    pems = []
    for i, k in enumerate(keys):
        pems += ["--public-key", str(r.export.parent / f"pinned-{i}.pem")]
        (r.export.parent / f"pinned-{i}.pem").write_bytes(public_key_pem(k.public_key()))
    res = cli("verify", "--export", str(r.export), *pems)
    assert res.exit_code == 1 and match in flat(res.output), res.output
    args = [a for k in keys for a in ("--vkey", r.vkey(k))]
    proc = standalone(r.export, *args)
    assert proc.returncode == 1 and match in proc.stderr, proc.stderr


# -- the operation and the format ----------------------------------------------------------------
def test_rotation_writes_a_hand_over_note_signed_by_both_keys(rotated: Rotated) -> None:
    r, n = rotated, rotated.handover_size
    rotation = [e for e in r.log.entries() if e.action == ROTATION_ACTION]
    assert len(rotation) == 1 and rotation[0].seq == n  # recorded right after the old key's last checkpoint
    note = rotation[0].details["note"]
    text, _, sigs = note.partition("\n\n")
    # the body, byte for byte (docs/audit-format.md, "Key rotation")
    root = _root_at(r.log, n)
    assert text + "\n" == handover_body(r.origin, n, root, r.vkey(r.old), r.vkey(r.new))
    assert text.split("\n") == [HANDOVER_HEADER, r.origin, str(n), base64.b64encode(root).decode(),
                                f"old {r.vkey(r.old)}", f"new {r.vkey(r.new)}"]
    lines = sigs.splitlines()
    assert [line.split(" ")[:2] for line in lines] == [[EM_DASH, r.origin]] * 2
    ids = [base64.b64decode(line.split(" ")[2])[:4] for line in lines]
    assert ids == [key_id(r.origin, r.old.public_key()), key_id(r.origin, r.new.public_key())]
    assert open_handover(note).tree_size == n
    # checkpoints: the old key up to the hand-over size, the new key after it; the origin is unchanged
    for cp in r.log.checkpoints():
        signer = r.old if cp.tree_size <= n else r.new
        assert key_id(r.origin, signer.public_key()) == base64.b64decode(cp.note.rsplit(" ", 1)[1])[:4], cp.tree_size
        assert cp.origin == r.origin
    assert max(c.tree_size for c in r.log.checkpoints() if c.tree_size <= n) == n
    # the export carries the note, covered by the manifest
    assert split_notes((r.export / "handovers.notes").read_text()) == [note]
    assert "handovers.notes" in json.loads((r.export / "manifest.json").read_text())["files"]


def test_all_verifiers_follow_the_hand_over_from_the_old_key(rotated: Rotated) -> None:
    r = rotated
    report = verify_export(r.export, public_key=r.old.public_key())
    assert report.ok and report.handovers_verified == 1 and report.entries == r.log.size(), report
    assert r.log.verify().ok and r.log.verify(public_key=r.old.public_key()).ok  # the log's own key, or pinned
    assert verify_export(r.export, public_key=[r.old.public_key(), r.new.public_key()]).ok
    res = cli("verify", "--export", str(r.export), "--public-key", str(r.old_pem))
    assert res.exit_code == 0 and "OK" in res.output, res.output
    proc = standalone(r.export, "--vkey", r.vkey(r.old))
    assert proc.returncode == 0 and "hand-over" in standalone(r.export, "--vkey", r.vkey(r.old), "--json").stdout
    # the embedded key is the new one: self-consistency still follows the chain back (exit 3: untrusted)
    assert standalone(r.export).returncode == 3
    assert verify_export(r.export).ok
    # an anchor file mixing old- and new-key checkpoints is accepted as held checkpoints
    report = verify_export(r.export, public_key=r.old.public_key(), trusted_notes=[r.anchor.read_text()])
    assert report.ok and report.trusted_verified == len(split_notes(r.anchor.read_text()))


def test_the_new_key_alone_does_not_vouch_for_the_old_history(rotated: Rotated) -> None:
    r = rotated
    report = verify_export(r.export, public_key=r.new.public_key())
    assert not report.ok and report.error.problem == "handover-untrusted"  # type: ignore[union-attr]
    assert "pass the key you trusted before the rotation" in str(report.error)
    assert standalone(r.export, "--vkey", r.vkey(r.new)).returncode == 1
    assert verify_export(r.export, public_key=[r.new.public_key(), r.old.public_key()]).ok


# -- attacks ---------------------------------------------------------------------------------------
def test_hand_over_signed_only_by_the_new_key_is_refused(rotated: Rotated) -> None:
    r = rotated
    note = split_notes((r.export / "handovers.notes").read_text())[0]
    body = note[: note.index("\n\n") + 1]
    (r.export / "handovers.notes").write_text(sign_note(body, r.origin, r.new))  # no signature by the old key
    _refresh_manifest(r.export, "handovers.notes")
    _all_refuse(r, match="not signed by the old key")


def test_hand_over_to_an_attacker_key_signed_only_by_it_is_refused(rotated: Rotated) -> None:
    """Someone without the old key hands the log to their own key and re-signs the newer checkpoints."""
    r, n = rotated, rotated.handover_size
    evil = Ed25519PrivateKey.generate()
    body = handover_body(r.origin, n, _root_at(r.log, n), r.vkey(r.old), r.vkey(evil))
    (r.export / "handovers.notes").write_text(sign_note(body, r.origin, evil))
    notes = split_notes((r.export / "checkpoints.note").read_text())
    resigned = [note if cp.tree_size <= n else sign_checkpoint(r.origin, cp.tree_size, cp.root_hash, r.origin, evil).note
                for note, cp in zip(notes, r.log.checkpoints(), strict=True)]
    (r.export / "checkpoints.note").write_text("".join(resigned))
    (r.export / "checkpoint.note").write_text(resigned[-1])
    _refresh_manifest(r.export, "handovers.notes", "checkpoints.note", "checkpoint.note")
    _all_refuse(r, match="not signed by the old key")


@pytest.mark.parametrize("tamper", ["size", "root", "new-key", "signature"])
def test_tampered_hand_over_is_refused(rotated: Rotated, tamper: str) -> None:
    r = rotated
    note = split_notes((r.export / "handovers.notes").read_text())[0]
    lines = note.split("\n")
    if tamper == "size":
        lines[2] = str(int(lines[2]) - 1)
    elif tamper == "root":
        lines[3] = base64.b64encode(bytes(32)).decode()
    elif tamper == "new-key":  # swap in another key, keeping the old key's signature
        lines[5] = f"new {verifier_key(r.origin, Ed25519PrivateKey.generate().public_key())}"
    else:
        sig_line = lines[-2]
        blob = bytearray(base64.b64decode(sig_line.rsplit(" ", 1)[1]))
        blob[10] ^= 1
        lines[-2] = sig_line.rsplit(" ", 1)[0] + " " + base64.b64encode(bytes(blob)).decode()
    (r.export / "handovers.notes").write_text("\n".join(lines))
    _refresh_manifest(r.export, "handovers.notes")
    _all_refuse(r, match="does not verify")


def test_checkpoint_by_an_unknown_key_is_refused(rotated: Rotated) -> None:
    r = rotated
    evil = Ed25519PrivateKey.generate()
    latest = r.log.latest_checkpoint()
    assert latest is not None
    forged = sign_checkpoint(r.origin, latest.tree_size, latest.root_hash, r.origin, evil).note
    notes = split_notes((r.export / "checkpoints.note").read_text())
    (r.export / "checkpoints.note").write_text("".join(notes[:-1]) + forged)
    (r.export / "checkpoint.note").write_text(forged)
    _refresh_manifest(r.export, "checkpoints.note", "checkpoint.note")
    _all_refuse(r, match="not signed by the trusted key")


def test_checkpoint_by_the_retired_key_after_the_hand_over_is_refused(rotated: Rotated) -> None:
    """The old key (perhaps the compromised one) signs a checkpoint after it was handed over."""
    r = rotated
    latest = r.log.latest_checkpoint()
    assert latest is not None and latest.tree_size > r.handover_size
    by_old = sign_checkpoint(r.origin, latest.tree_size, latest.root_hash, r.origin, r.old).note
    notes = split_notes((r.export / "checkpoints.note").read_text())
    (r.export / "checkpoints.note").write_text("".join(notes[:-1]) + by_old)
    (r.export / "checkpoint.note").write_text(by_old)
    _refresh_manifest(r.export, "checkpoints.note", "checkpoint.note")
    _all_refuse(r, match=f"retired at hand-over size {r.handover_size}")
    # even when the auditor pins both keys
    _all_refuse(r, pinned=(r.old, r.new), match=f"retired at hand-over size {r.handover_size}")
    # and the database verifier, for a checkpoint row the old key signed after the hand-over
    report = r.log.verify(trusted_checkpoints=[by_old])
    assert not report.ok and report.error.problem == "key-retired"  # type: ignore[union-attr]


def test_writer_with_the_retired_key_refuses_to_sign(rotated: Rotated, tmp_path: Path) -> None:
    r = rotated
    stale = AuditLog(tmp_path / "audit.db", signing_key=tmp_path / "old.pem", checkpoint_every=None)
    stale.record("dataset.read", "dataset:late")
    before = len(r.log.checkpoints())
    with pytest.raises(AuditConfigError, match=f"retired at tree size {r.handover_size}"):
        stale.checkpoint()
    assert len(r.log.checkpoints()) == before
    stale.close()
    assert r.log.checkpoint().tree_size == r.log.size()  # the new key signs the late entry


def test_rotation_to_the_same_key_is_refused(rotated: Rotated, tmp_path: Path) -> None:
    r = rotated
    size = r.log.size()
    checkpoints = len(r.log.checkpoints())
    with pytest.raises(AuditConfigError, match="same key"):
        r.log.rotate_key(tmp_path / "new.pem")  # the current key
    assert len(r.log.checkpoints()) == checkpoints
    with pytest.raises(AuditConfigError, match="already used"):
        r.log.rotate_key(tmp_path / "old.pem")  # a retired key coming back
    assert r.log.size() == size  # nothing recorded
    # a crafted same-key hand-over in an export is refused by the verifiers
    n = r.handover_size
    body = handover_body(r.origin, n, _root_at(r.log, n), r.vkey(r.old), r.vkey(r.old))
    note = sign_note(body, r.origin, r.old)
    (r.export / "handovers.notes").write_text(note + (r.export / "handovers.notes").read_text())
    _refresh_manifest(r.export, "handovers.notes")
    _all_refuse(r, match="same key")


def test_second_hand_over_from_the_retired_key_is_refused(rotated: Rotated) -> None:
    """Whoever holds the old key forks the chain: a second hand-over to their own key."""
    r, n = rotated, rotated.handover_size
    evil = Ed25519PrivateKey.generate()
    size = r.log.latest_checkpoint().tree_size  # type: ignore[union-attr]
    body = handover_body(r.origin, size, _root_at(r.log, size), r.vkey(r.old), r.vkey(evil))
    fork = sign_note(body, r.origin, r.old)
    fork = fork + f"{EM_DASH} {r.origin} " + base64.b64encode(
        key_id(r.origin, evil.public_key()) + evil.sign(body.encode())).decode() + "\n"
    (r.export / "handovers.notes").write_text((r.export / "handovers.notes").read_text() + fork)
    _refresh_manifest(r.export, "handovers.notes")
    _all_refuse(r, match=f"already retired at size {n}")


# -- proofs (`securetrain audit prove`) across a rotation ------------------------------------------------
def _prove(r: Rotated, tmp_path: Path, *args: str) -> tuple[dict, Path]:
    res = cli("prove", *args, "--db", r.log.url)
    assert res.exit_code == 0, res.output
    path = tmp_path / f"proof-{len(list(tmp_path.glob('proof-*.json')))}.json"
    path.write_text(res.output)
    return json.loads(res.output), path


def _proof_refused(r: Rotated, tmp_path: Path, proof: dict, match: str, *keys: Ed25519PrivateKey) -> None:
    bad = tmp_path / "bad-proof.json"
    bad.write_text(json.dumps(proof))
    args = [a for k in (keys or (r.old,)) for a in ("--vkey", r.vkey(k))]
    proc = standalone(Path(""), "--proof", str(bad), *args)
    assert proc.returncode == 1 and match in proc.stderr, (proc.stdout, proc.stderr)


def test_standalone_proof_follows_the_hand_over_from_the_old_key(rotated: Rotated, tmp_path: Path) -> None:
    r, n = rotated, rotated.handover_size
    latest = r.log.latest_checkpoint()
    assert latest is not None and latest.tree_size > n  # signed by the new key
    inclusion, inc_path = _prove(r, tmp_path, "2")
    consistency, cons_path = _prove(r, tmp_path, "--consistency", "4")
    note = split_notes((r.export / "handovers.notes").read_text())[0]
    for proof, size in ((inclusion, inclusion["tree_size"]), (consistency, consistency["new_size"])):
        assert size == latest.tree_size
        assert [h["note"] for h in proof["handovers"]] == [note]  # the notes recorded below the proven size
        assert proof["handovers"][0]["consistency"] == r.log.consistency_proof(n, size)["proof"]
    held = tmp_path / "held.note"
    held.write_text(split_notes(r.anchor.read_text())[0])  # size 4, signed by the old key
    for path, extra in ((inc_path, []), (cons_path, ["--trusted-checkpoint", str(held)])):
        proc = standalone(Path(""), "--proof", str(path), "--vkey", r.vkey(r.old), *extra, "--json")
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        assert any("hand-over" in c for c in json.loads(proc.stdout)["checks"]), proc.stdout
        # pinning both keys works too; the new key alone does not vouch for the old history
        both = standalone(Path(""), "--proof", str(path), "--vkey", r.vkey(r.old), "--vkey", r.vkey(r.new), *extra)
        assert both.returncode == 0, both.stderr
        only_new = standalone(Path(""), "--proof", str(path), "--vkey", r.vkey(r.new))
        assert only_new.returncode == 1 and "neither trusted nor handed over to" in only_new.stderr, only_new.stderr
    # a proof at the old key's last checkpoint (the hand-over size) needs no hand-over
    at_handover, path = _prove(r, tmp_path, "1", "--size", str(n))
    assert at_handover["handovers"] == []
    assert standalone(Path(""), "--proof", str(path), "--vkey", r.vkey(r.old)).returncode == 0


def test_standalone_proof_refuses_a_missing_forged_or_wrongly_signed_hand_over(rotated: Rotated, tmp_path: Path) -> None:
    r, n = rotated, rotated.handover_size
    proof, _ = _prove(r, tmp_path, "2")
    size, root = proof["tree_size"], bytes.fromhex(proof["root_hash"])
    note = proof["handovers"][0]["note"]
    link = proof["handovers"][0]["consistency"]
    # missing: the new key's checkpoint is then signed by no accepted key
    _proof_refused(r, tmp_path, {**proof, "handovers": []}, "not signed by the trusted key")
    _proof_refused(r, tmp_path, {k: v for k, v in proof.items() if k != "handovers"}, "not signed by the trusted key")
    # forged: the old key's signature altered
    lines = note.split("\n")
    blob = bytearray(base64.b64decode(lines[-3].rsplit(" ", 1)[1]))
    blob[10] ^= 1
    lines[-3] = lines[-3].rsplit(" ", 1)[0] + " " + base64.b64encode(bytes(blob)).decode()
    _proof_refused(r, tmp_path, {**proof, "handovers": [{"note": "\n".join(lines), "consistency": link}]},
                   "does not verify")
    # an attacker hands the log to their own key, signing only with it, and re-signs the checkpoint
    evil = Ed25519PrivateKey.generate()
    evil_note = sign_note(handover_body(r.origin, n, _root_at(r.log, n), r.vkey(r.old), r.vkey(evil)), r.origin, evil)
    evil_cp = sign_checkpoint(r.origin, size, root, r.origin, evil).note
    _proof_refused(r, tmp_path, {**proof, "checkpoint": evil_cp,
                                 "handovers": [{"note": evil_note, "consistency": link}]}, "not signed by the old key")
    # signed by the wrong key: a well-formed hand-over between two keys the auditor never trusted
    evil2 = Ed25519PrivateKey.generate()
    body = handover_body(r.origin, n, _root_at(r.log, n), r.vkey(evil), r.vkey(evil2))
    wrong = sign_note(body, r.origin, evil) + f"{EM_DASH} {r.origin} " + base64.b64encode(
        key_id(r.origin, evil2.public_key()) + evil2.sign(body.encode())).decode() + "\n"
    _proof_refused(r, tmp_path, {**proof, "checkpoint": sign_checkpoint(r.origin, size, root, r.origin, evil2).note,
                                 "handovers": [{"note": wrong, "consistency": link}]}, "neither trusted nor handed over to")
    # the retired old key signs the proven (newer) tree
    by_old = sign_checkpoint(r.origin, size, root, r.origin, r.old).note
    _proof_refused(r, tmp_path, {**proof, "checkpoint": by_old}, f"retired at hand-over size {n}")
    # the proven tree must extend the tree the hand-over signs (as an export's entries must match it)
    _proof_refused(r, tmp_path, {**proof, "handovers": [{"note": note, "consistency": list(reversed(link))}]},
                   "does not extend the tree of")
    _proof_refused(r, tmp_path, {**proof, "handovers": [{"note": note}]}, "handovers")


# -- the writer's published-checkpoint check across a rotation --------------------------------------
def test_writer_with_new_key_checks_old_key_published_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the anchors hold the truth, and all they hold is signed by the old key: still refused."""
    from test_audit_security import _rewrite_history

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    old_path, new_path = tmp_path / "old.pem", tmp_path / "new.pem"
    create_signing_key(old_path)
    create_signing_key(new_path)
    db = tmp_path / "audit.db"
    published_by_old = FileAnchor(tmp_path / "old-anchor.notes")
    with AuditLog(db, signing_key=old_path, anchors=[published_by_old], checkpoint_every=None) as log:
        for i in range(10):
            log.record("dataset.read", f"dataset:{i}")
        log.checkpoint()
        origin = log.origin
    with AuditLog(db, signing_key=old_path, checkpoint_every=None) as log:
        log.rotate_key(new_path)
    only_old = FileAnchor(tmp_path / "only-old.notes")  # what the anchor held before the new key published
    only_old.path.write_bytes(published_by_old.path.read_bytes())
    writer = AuditLog(db, signing_key=new_path, anchors=[published_by_old], checkpoint_every=None)
    assert writer.origin == origin  # taken from the hand-over signed by its key
    writer.record("dataset.read", "dataset:10")
    assert writer.checkpoint().origin == origin  # old-key anchors are accepted references
    writer.close()
    _rewrite_history(db, drop_checkpoints=True)
    fresh = AuditLog(db, signing_key=new_path, anchors=[only_old], checkpoint_every=None)
    fresh.record("dataset.read", "dataset:11")
    with pytest.raises(AuditIntegrityError, match="rewritten"):
        fresh.checkpoint()
    fresh.close()


# -- CLI end to end ----------------------------------------------------------------------------------
def test_cli_keygen_rotate_key_export_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SECURETRAIN_AUDIT_KEY", raising=False)
    old_path, new_path, db = tmp_path / "old.pem", tmp_path / "new.pem", str(tmp_path / "audit.db")
    assert cli("keygen", "--out", str(old_path)).exit_code == 0
    assert cli("keygen", "--out", str(new_path)).exit_code == 0
    with AuditLog(db, signing_key=old_path, checkpoint_every=3) as log:
        for i in range(7):
            log.record("dataset.read", f"dataset:{i}")
    same = cli("rotate-key", "--db", db, "--signing-key", str(old_path), "--new-key", str(old_path))
    assert same.exit_code != 0 and "same key" in flat(str(same.exception) + same.output)
    res = cli("rotate-key", "--db", db, "--signing-key", str(old_path), "--new-key", str(new_path))
    assert res.exit_code == 0, res.output
    assert HANDOVER_HEADER in res.output
    assert cli("verify", "--db", db, "--signing-key", str(new_path)).exit_code == 0
    assert cli("checkpoint", "--db", db, "--signing-key", str(old_path)).exit_code != 0  # retired
    out = tmp_path / "export"
    assert cli("export", str(out), "--db", db, "--signing-key", str(new_path)).exit_code == 0
    old_pub = tmp_path / "old.pub.pem"
    ok = cli("verify", "--export", str(out), "--public-key", str(old_pub))
    assert ok.exit_code == 0, ok.output
    assert standalone(out, "--public-key", str(old_pub)).returncode == 0
    only_new = cli("verify", "--export", str(out), "--public-key", str(tmp_path / "new.pub.pem"))
    assert only_new.exit_code == 1
    both = cli("verify", "--export", str(out), "--public-key", str(old_pub), "--public-key", str(tmp_path / "new.pub.pem"))
    assert both.exit_code == 0, both.output


# -- PostgreSQL ----------------------------------------------------------------------------------------
@pytest.mark.postgres
def test_rotation_on_postgres(tmp_path: Path, pg_schema: str) -> None:
    schema = pg_schema
    old_path, new_path = tmp_path / "old.pem", tmp_path / "new.pem"
    old, _ = create_signing_key(old_path), create_signing_key(new_path)
    with AuditLog(POSTGRES_URL, schema=schema, signing_key=old_path, checkpoint_every=5) as log:
        log.append_many([("train.start", f"run:{i}", "success", {"step": i}) for i in range(7)])
        handover = log.rotate_key(new_path)
        log.append_many([("train.step", f"run:{i}", "success", {"step": i}) for i in range(4)])
        origin = log.origin
    assert handover.tree_size == 7
    # a second writer process with the new key: same origin, signs; one with the old key refuses
    with AuditLog(POSTGRES_URL, schema=schema, signing_key=new_path, checkpoint_every=None) as log:
        assert log.origin == origin
        log.record("train.end", "run:0")
        assert log.checkpoint().tree_size == log.size()
        assert log.verify().ok and log.verify(public_key=old.public_key()).ok
        out = log.export(tmp_path / "export")
    with AuditLog(POSTGRES_URL, schema=schema, signing_key=old_path, checkpoint_every=None) as stale:
        stale.record("train.end", "run:1")
        with pytest.raises(AuditConfigError, match="retired"):
            stale.checkpoint()
    assert verify_export(out, public_key=old.public_key()).ok
    assert standalone(out, "--vkey", verifier_key(origin, old.public_key())).returncode == 0


def test_a_checkpoint_racing_a_rotation_is_never_signed_by_the_retired_key(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared committer's periodic checkpoint runs on its own thread after a commit. Before, it
    took the signing key first and the lock later: when a rotation committed its hand-over and
    switched keys in between, it signed the new tree size with the retired key (seen in CI: the log
    then failed verification with "signed by a key retired at hand-over size ...")."""
    import threading

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    log = AuditLog(tmp_path / "audit.db", signing_key=Ed25519PrivateKey.generate(), checkpoint_every=None)
    for i in range(3):
        log.record("dataset.read", f"dataset:{i}")
    racer_started, go = threading.Event(), threading.Event()
    racer = threading.current_thread()  # replaced below
    original_reference = AuditLog._published_reference
    original_checkpoint = AuditLog.checkpoint
    main_calls: list[int] = []

    def held_racer(self: AuditLog) -> object:
        if threading.current_thread() is racer:  # the racing checkpoint waits here, its key already chosen before
            racer_started.set()
            go.wait(30)
        return original_reference(self)

    def checkpoint(self: AuditLog) -> object:
        if threading.current_thread() is threading.main_thread():
            main_calls.append(1)
            if len(main_calls) == 2:  # rotate_key's final checkpoint: the hand-over is committed, the key switched
                go.set()
                racer.join(30)
        return original_checkpoint(self)

    monkeypatch.setattr(AuditLog, "_published_reference", held_racer)
    monkeypatch.setattr(AuditLog, "checkpoint", checkpoint)
    errors: list[BaseException] = []

    def race() -> None:
        try:
            original_checkpoint(log)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    racer = threading.Thread(target=race)
    racer.start()
    assert racer_started.wait(30)
    log.rotate_key(Ed25519PrivateKey.generate())
    racer.join(30)
    assert not errors
    report = log.verify()
    assert report.ok, report.error
    assert not [e for e in log.entries() if e.action == "audit.alert"]  # no unverifiable row was met
    log.close()

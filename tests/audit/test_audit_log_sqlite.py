"""AuditLog on SQLite: recording rules, DB-enforced append-only, tamper detection, export + verifier."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from securetrain.audit import canonical
from securetrain.audit.anchors import FileAnchor, FsspecAnchor
from securetrain.audit.errors import AuditError, AuditEventError, AuditIntegrityError
from securetrain.audit.log import AuditLog, open_audit_log
from securetrain.audit.merkle import verify_inclusion
from securetrain.audit.note import key_id, open_checkpoint, parse_verifier_key, split_notes
from securetrain.audit.recorder import AuditRecorder
from securetrain.audit.triggers import SQLITE_TRIGGER_NAMES

REPO = Path(__file__).resolve().parents[2]
VERIFIER = REPO / "audit" / "verify_audit.py"


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AuditLog:
    from securetrain.audit.keys import create_signing_key

    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("SECURETRAIN_AUDIT_KEY")
    create_signing_key(tmp_path / "data" / "audit_signing_key.pem")  # what `securetrain audit keygen` does
    lg = AuditLog(tmp_path / "audit.db", actor="alice", checkpoint_every=4)
    for i in range(10):
        lg.record("dataset.read", f"dataset:{i}", details={"rows": i, "sha256": "ab" * 32, "tags": ["x", None, True]})
    yield lg
    lg.close()


def raw_db(log: AuditLog, drop_triggers: bool = True) -> sqlite3.Connection:
    """An attacker with file access: plain sqlite3, triggers dropped."""
    conn = sqlite3.connect(log.url.removeprefix("sqlite:///"), isolation_level=None)
    if drop_triggers:
        for name in SQLITE_TRIGGER_NAMES:
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    return conn


def run_verifier(export: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", str(VERIFIER), str(export), *args], capture_output=True, text=True, timeout=60)


# -- recording ---------------------------------------------------------------------------
def test_entries_have_required_fields_and_chain(log: AuditLog) -> None:
    assert isinstance(log, AuditRecorder)
    entries = list(log.entries())
    assert [e.seq for e in entries] == list(range(10))
    assert entries[0].prev_hash == "0" * 64
    for a, b in zip(entries, entries[1:], strict=False):
        assert b.prev_hash == a.entry_hash
    e = entries[3]
    assert e.actor == "alice" and len(e.mac) == 17 and e.hostname
    assert e.ts.endswith("Z") and len(e.ts) == len("2024-01-01T00:00:00.000000Z")
    assert e.entry_hash == canonical.sha256_hex(e.hashed_bytes())
    assert json.loads(e.hashed_bytes())["v"] == 1
    assert [c.tree_size for c in log.checkpoints()] == [4, 8]
    # No database server asserts anything on SQLite: no server_view column, member or hash input.
    assert e.server_view is None and "server_view" not in json.loads(e.hashed_bytes())
    columns = [r[1] for r in raw_db(log, drop_triggers=False).execute("PRAGMA table_info(audit_entries)")]
    assert "server_view" not in columns


@pytest.mark.parametrize(
    "details",
    [{"password": "hunter2"}, {"api_key": "x"}, {"nested": {"sessionToken": "x"}}, {"score": float("nan")},
     {"score": float("inf")},
     {"k": object()}, {"big": 2**60}, {1: "x"}, {"pem": "-----BEGIN PRIVATE KEY-----\nMII"}, {"blob": "x" * 20000}],
)
def test_refuses_secret_shaped_or_non_json_details(log: AuditLog, details: dict) -> None:
    with pytest.raises(AuditEventError):
        log.record("key.use", "k", details=details)
    assert log.size() == 10  # nothing was written


def test_floats_are_stored_as_round_trip_strings(log: AuditLog) -> None:
    e = log.record("training.stop", "run", details={"final_loss": 0.1 + 0.2, "nested": [1e-07, 2.5]})
    assert e.details == {"final_loss": "0.30000000000000004", "nested": ["1e-07", "2.5"]}
    assert float(e.details["final_loss"]) == 0.1 + 0.2
    assert log.verify().ok


def test_allows_ids_and_digests(log: AuditLog) -> None:
    e = log.record("key.use", "kms", details={"key_id": "k-1", "token_sha256": "00" * 32, "token_count": 3})
    assert e.details["key_id"] == "k-1"


@pytest.mark.parametrize(("action", "resource", "outcome"), [("Bad Action", "r", "success"), ("a.b", "", "success"),
                                                             ("a.b", "line\nbreak", "success"), ("a.b", "r", "OK!")])
def test_refuses_bad_event_fields(log: AuditLog, action: str, resource: str, outcome: str) -> None:
    with pytest.raises(AuditEventError):
        log.record(action, resource, outcome=outcome)


def test_append_many_is_atomic(log: AuditLog) -> None:
    with pytest.raises(AuditEventError):
        log.append_many([("a.b", "r1", "success", None), ("a.b", "r2", "success", {"secret": "x"})])
    assert log.size() == 10
    out = log.append_many([("a.b", "r1", "success", None), {"action": "a.c", "resource": "r2", "details": {"n": 1}}])
    assert [e.seq for e in out] == [10, 11] and log.verify().ok


def test_threads_share_one_log(log: AuditLog) -> None:
    def work() -> None:
        for i in range(15):
            log.record("thread.write", f"r{i}")

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.size() == 100 and log.verify().ok


def test_signing_key_created_owner_only(log: AuditLog, tmp_path: Path) -> None:
    path = tmp_path / "data" / "audit_signing_key.pem"
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(Exception, match="readable by others"):
        AuditLog(log.url, checkpoint_every=None).checkpoint()


def test_library_never_creates_a_signing_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A writer started from another directory once created a fresh key there, committed its
    # entries, then failed at the first checkpoint blaming "tampering". Now: no key, no entries.
    from securetrain.audit.errors import AuditConfigError
    from securetrain.audit.keys import create_signing_key

    monkeypatch.delenv("SECURETRAIN_AUDIT_KEY")
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(AuditConfigError, match="audit signing key not found") as err:
        AuditLog(tmp_path / "audit.db")
    assert "securetrain audit keygen" in str(err.value)
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "audit.db").exists()
    reader = AuditLog(tmp_path / "r.db", checkpoint_every=None)  # no checkpoints: no key needed to append
    reader.record("a.b", "r")
    with pytest.raises(AuditConfigError, match="not found"):
        reader.checkpoint()
    reader.close()
    assert not (tmp_path / "elsewhere").exists()
    create_signing_key(tmp_path / "k.pem")
    with pytest.raises(AuditConfigError, match="already exists"):  # keygen never replaces a key
        create_signing_key(tmp_path / "k.pem")


def test_keygen_command_creates_the_key_once(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from securetrain.audit.keys import load_signing_key
    from securetrain.cli.main import app

    out = tmp_path / "keys" / "audit.pem"
    r = CliRunner().invoke(app, ["audit", "keygen", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and (tmp_path / "keys" / "audit.pub.pem").is_file()
    assert "verifier key" in r.output and "PRIVATE" not in r.output
    first = out.read_bytes()
    load_signing_key(out)
    r = CliRunner().invoke(app, ["audit", "keygen", "--out", str(out)])
    assert r.exit_code != 0 and "already exists" in f"{r.exception} {r.output}"
    assert out.read_bytes() == first


def test_open_audit_log_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "dd"))
    monkeypatch.delenv("SECURETRAIN_AUDIT_URL", raising=False)
    with open_audit_log() as lg:
        lg.record("a.b", "r")
    assert (tmp_path / "dd" / "audit.db").exists()


# -- database-level append-only ------------------------------------------------------------
@pytest.mark.parametrize(
    "sql",
    ["UPDATE audit_entries SET actor='mallory' WHERE seq=3", "DELETE FROM audit_entries WHERE seq=9",
     "DELETE FROM audit_entries", "UPDATE audit_checkpoints SET note='x'", "DELETE FROM audit_checkpoints",
     "INSERT OR REPLACE INTO audit_entries SELECT * FROM audit_entries WHERE seq=9",
     "INSERT OR REPLACE INTO audit_entries SELECT * FROM audit_entries WHERE seq=2",
     "INSERT INTO audit_entries SELECT seq+1, ts, actor, hostname, mac, action, resource, outcome, details, "
     "'f00d' || substr(prev_hash, 5), entry_hash FROM audit_entries WHERE seq=9",
     "INSERT INTO audit_entries (seq, ts, actor, hostname, mac, action, resource, outcome, details, prev_hash, entry_hash) "
     "SELECT 12, ts, actor, hostname, mac, action, resource, outcome, details, entry_hash, entry_hash FROM audit_entries WHERE seq=9",
     "INSERT INTO audit_entries (seq, ts, actor, hostname, mac, action, resource, outcome, details, prev_hash, entry_hash) "
     "VALUES (10, 't', 'a', 'h', 'm', 'x', 'r', 'success', '{}', 'ff', 'ff') ON CONFLICT(seq) DO UPDATE SET actor='m'",
     "INSERT OR REPLACE INTO audit_checkpoints SELECT * FROM audit_checkpoints"],
)
def test_sqlite_triggers_block_rewrites(log: AuditLog, sql: str) -> None:
    conn = raw_db(log, drop_triggers=False)
    before = conn.execute("SELECT count(*), group_concat(entry_hash) FROM audit_entries").fetchone()
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute(sql)
    assert conn.execute("SELECT count(*), group_concat(entry_hash) FROM audit_entries").fetchone() == before
    assert log.verify().ok


# -- tampering (attacker drops the triggers) -------------------------------------------------
FIELD_EDITS = {
    "ts": "'2020-01-01T00:00:00.000000Z'", "actor": "'mallory'", "hostname": "'elsewhere'", "mac": "'00:00:00:00:00:00'",
    "action": "'dataset.delete'", "resource": "'dataset:other'", "outcome": "'failure'", "details": "'{\"rows\":999}'",
    "prev_hash": "'" + "1" * 64 + "'", "entry_hash": "'" + "2" * 64 + "'", "seq": "99",
}


@pytest.mark.parametrize("field", sorted(FIELD_EDITS))
def test_editing_any_field_is_detected(log: AuditLog, field: str) -> None:
    raw_db(log).execute(f"UPDATE audit_entries SET {field} = {FIELD_EDITS[field]} WHERE seq = 5")
    report = log.verify()
    assert not report.ok and report.error is not None
    assert report.error.seq == 5, report.error
    with pytest.raises(AuditIntegrityError, match="seq=5"):
        report.raise_for_failure()


def test_non_canonical_details_text_is_detected(log: AuditLog) -> None:
    raw_db(log).execute("UPDATE audit_entries SET details = replace(details, ':', ': ') WHERE seq = 2")
    report = log.verify()
    assert not report.ok and report.error.seq == 2  # type: ignore[union-attr]


def test_rehashed_edit_breaks_the_next_link(log: AuditLog) -> None:
    """Attacker edits entry 5 and recomputes its entry_hash: entry 6 no longer links."""
    e = list(log.entries())[5]
    forged = e.hashed_object() | {"actor": "mallory"}
    new_hash = canonical.sha256_hex(canonical.canonical_bytes(forged))
    raw_db(log).execute("UPDATE audit_entries SET actor='mallory', entry_hash=? WHERE seq=5", (new_hash,))
    report = log.verify()
    assert report.error is not None and report.error.seq == 6 and report.error.problem == "prev_hash"


@pytest.mark.parametrize(
    ("sql", "seq"),
    [("DELETE FROM audit_entries WHERE seq = 4", 4),
     ("UPDATE audit_entries SET seq = -seq WHERE seq IN (3, 4); UPDATE audit_entries SET seq = 7 - seq WHERE seq IN (-3, -4)", 3),
     ("INSERT INTO audit_entries SELECT 100, ts, actor, hostname, mac, action, resource, outcome, details, prev_hash, entry_hash "
      "FROM audit_entries WHERE seq = 2; UPDATE audit_entries SET seq = seq + 1 WHERE seq >= 3 AND seq < 100;"
      "UPDATE audit_entries SET seq = 3 WHERE seq = 100", 3)],
    ids=["delete", "reorder", "insert"],
)
def test_delete_reorder_insert_detected(log: AuditLog, sql: str, seq: int) -> None:
    conn = raw_db(log)
    if "seq + 1" in sql:  # shift from the top down to avoid PK clashes
        conn.execute("INSERT INTO audit_entries SELECT 100, ts, actor, hostname, mac, action, resource, outcome, details, "
                     "prev_hash, entry_hash FROM audit_entries WHERE seq = 2")
        for s in range(9, 2, -1):
            conn.execute("UPDATE audit_entries SET seq = ? WHERE seq = ?", (s + 1, s))
        conn.execute("UPDATE audit_entries SET seq = 3 WHERE seq = 100")
    else:
        conn.executescript(sql)
    report = log.verify()
    assert not report.ok and report.error.seq == seq, report.error  # type: ignore[union-attr]


def test_truncated_tail_caught_by_checkpoint(log: AuditLog) -> None:
    held = log.checkpoint().note  # auditor keeps this (size 10)
    conn = raw_db(log)
    conn.execute("DELETE FROM audit_entries WHERE seq >= 7")
    conn.execute("DELETE FROM audit_checkpoints WHERE tree_size > 7")
    assert log.verify().ok  # the chain alone looks fine ...
    report = log.verify(trusted_checkpoints=[held])  # ... the held checkpoint does not
    assert not report.ok and report.error.problem == "truncated" and report.error.seq == 7  # type: ignore[union-attr]


def test_forged_recomputed_chain_caught_by_checkpoint(log: AuditLog, tmp_path: Path) -> None:
    held = log.checkpoint().note
    real_key = log.public_key
    # Attacker rebuilds the whole database with altered history and their own key.
    os.remove(log.url.removeprefix("sqlite:///"))
    forged = AuditLog(log.url, actor="alice", signing_key=Ed25519PrivateKey.generate(), origin=log.origin, checkpoint_every=4)
    for i in range(10):
        forged.record("dataset.read", f"dataset:{i if i != 3 else 'swapped'}", details={"rows": i})
    forged.checkpoint()
    assert forged.verify().ok  # self-consistent forgery
    report = forged.verify(public_key=real_key)  # auditor's trusted key: stored checkpoints are not signed by it
    assert not report.ok and report.error.problem == "note-unknown-key"  # type: ignore[union-attr]
    report = forged.verify(trusted_checkpoints=[held])
    assert not report.ok and report.error.problem in ("note-unknown-key", "checkpoint-root")  # type: ignore[union-attr]
    # Even if the attacker had the real key, the root at size 10 differs from the held checkpoint.
    resigned = AuditLog(tmp_path / "other.db", signing_key=log.signing_key, origin=log.origin)
    for i in range(10):
        resigned.record("dataset.read", f"dataset:{i}", details={"rows": -i})
    report = resigned.verify(trusted_checkpoints=[held])
    assert not report.ok and report.error.problem == "checkpoint-root"  # type: ignore[union-attr]


def test_forged_checkpoint_signature_detected(log: AuditLog) -> None:
    cp = log.checkpoints()[-1]
    body_forged = cp.note.replace(f"\n{cp.tree_size}\n", f"\n{cp.tree_size + 0}\n").replace(cp.note.split("\n")[2], "A" * 43 + "=")
    raw_db(log).execute("UPDATE audit_checkpoints SET note=? WHERE tree_size=?", (body_forged, cp.tree_size))
    report = log.verify()
    assert not report.ok and report.error.problem == "note-bad-signature"  # type: ignore[union-attr]


# -- checkpoints, proofs, anchors ----------------------------------------------------------------
def test_checkpoint_format_and_proofs(log: AuditLog) -> None:
    cp = log.checkpoint()
    lines = cp.note.split("\n")
    assert lines[0] == log.origin and lines[1] == "10" and lines[3] == ""
    assert lines[4].startswith("\u2014 " + log.origin + " ")
    name, pub = parse_verifier_key(log.verifier_key())
    assert name == log.origin and key_id(name, pub) == key_id(log.origin, log.public_key)
    assert open_checkpoint(cp.note, name, pub).tree_size == 10
    assert log.checkpoint().note == cp.note  # idempotent when nothing new
    p = log.inclusion_proof(7)
    assert p["root_hash"] == cp.root_hash.hex()
    from securetrain.audit.merkle import leaf_hash

    assert verify_inclusion(7, 10, leaf_hash(p["entry"].encode()), [bytes.fromhex(x) for x in p["proof"]], cp.root_hash)
    c = log.consistency_proof(4, 10)
    from securetrain.audit.merkle import verify_consistency

    assert verify_consistency(4, 10, [bytes.fromhex(x) for x in c["proof"]], bytes.fromhex(c["old_root"]), cp.root_hash)
    assert c["old_root"] == log.checkpoints()[0].root_hash.hex()


def test_anchors_receive_every_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    fa, ma = FileAnchor(tmp_path / "anchor.notes"), FsspecAnchor(f"memory://anchors-{os.getpid()}-{id(tmp_path)}")
    lg = AuditLog(tmp_path / "a.db", checkpoint_every=3, anchors=[fa, ma])
    for i in range(7):
        lg.record("a.b", f"r{i}")
    lg.checkpoint()
    want = [c.note for c in lg.checkpoints()]
    assert [n for n in fa.notes()] == want == ma.notes() and len(want) == 3
    assert split_notes("".join(want)) == want
    assert stat.S_IMODE((tmp_path / "anchor.notes").stat().st_mode) == 0o600
    with pytest.raises(AuditError):
        ma.publish(lg.checkpoints()[0])  # never overwrites


# -- export + standalone verifier -----------------------------------------------------------------
def test_export_verifies_with_standalone_verifier(log: AuditLog, tmp_path: Path) -> None:
    log.record("unicode.check", "r", details={"s": "é\u2028\n\"\\\x01", "🙂": 1, "a": {"é": [], "e": {}}})
    out = log.export(tmp_path / "exp")
    lines = (out / "entries.jsonl").read_bytes().splitlines()
    assert len(lines) == 11 and canonical.sha256_hex(lines[3]) == list(log.entries())[3].entry_hash
    html = tmp_path / "report.html"
    r = run_verifier(out, "--vkey", log.verifier_key(), "--html", str(html))
    assert r.returncode == 0, r.stderr
    assert "OK: 11 entries" in r.stdout and "VERIFIED" in html.read_text()
    import ast

    tree = ast.parse(VERIFIER.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "argparse", "base64", "binascii", "hashlib", "html", "json", "re", "sys",
                        "pathlib", "cryptography", "subprocess", "os"}, imported


def _tamper_line(out: Path, seq: int, fn) -> None:  # noqa: ANN001
    lines = (out / "entries.jsonl").read_bytes().splitlines(keepends=True)
    lines = fn(lines, seq)
    data = b"".join(lines)
    (out / "entries.jsonl").write_bytes(data)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["entries.jsonl"] = canonical.sha256_hex(data)  # attacker fixes the manifest too
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("name", "fn", "seq"),
    [("edit-actor", lambda ls, s: ls[:s] + [ls[s].replace(b'"actor":"alice"', b'"actor":"bob"')] + ls[s + 1:], 5),
     ("non-canonical", lambda ls, s: ls[:s] + [ls[s].replace(b'","', b'", "', 1)] + ls[s + 1:], 5),
     ("delete", lambda ls, s: ls[:s] + ls[s + 1:], 5),
     ("swap", lambda ls, s: ls[:s] + [ls[s + 1], ls[s]] + ls[s + 2:], 5),
     ("truncate", lambda ls, s: ls[:s], 8),
     ("float", lambda ls, s: ls[:s] + [ls[s].replace(b'"rows":5', b'"rows":5.5')] + ls[s + 1:], 5)],
)
def test_standalone_verifier_detects_tampering(log: AuditLog, tmp_path: Path, name: str, fn, seq: int) -> None:  # noqa: ANN001
    out = log.export(tmp_path / "exp")
    _tamper_line(out, seq, fn)
    r = run_verifier(out, "--vkey", log.verifier_key())
    assert r.returncode == 1, (name, r.stdout, r.stderr)
    assert "FAILED" in r.stderr
    assert f"seq={seq}" in r.stderr or f"(entry {seq} or" in r.stderr or (name == "truncate" and "tail was removed" in r.stderr), r.stderr


def test_standalone_verifier_trusted_checkpoint_and_wrong_key(log: AuditLog, tmp_path: Path) -> None:
    held = tmp_path / "held.note"
    held.write_text(log.checkpoint().note)
    out = log.export(tmp_path / "exp")
    assert run_verifier(out, "--vkey", log.verifier_key(), "--trusted-checkpoint", str(held)).returncode == 0
    # Tail removed together with the export's own checkpoints: only the held note notices.
    for f in ("checkpoints.note",):
        notes = [n for n in split_notes((out / f).read_text()) if n.split("\n")[1] in ("4",)]
        (out / f).write_text("".join(notes))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["checkpoints.note"] = canonical.sha256_hex((out / "checkpoints.note").read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest))
    # Cut between checkpoints: the unsigned entries 4..5 give it away even without a held note.
    _tamper_line(out, 6, lambda ls, s: ls[:s])
    r = run_verifier(out, "--vkey", log.verifier_key())
    assert r.returncode == 1 and "not covered by a signed checkpoint" in r.stderr
    # Cut exactly at a stored checkpoint: checkpoint.note and the manifest still name the full tree.
    _tamper_line(out, 4, lambda ls, s: ls[:s])
    r = run_verifier(out, "--vkey", log.verifier_key())
    assert r.returncode == 1 and "checkpoint.note" in r.stderr, r.stderr
    # ... and with those rewritten too, it is self-consistent, so only the held note notices.
    (out / "checkpoint.note").write_text((out / "checkpoints.note").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["checkpoint.note"] = canonical.sha256_hex((out / "checkpoint.note").read_bytes())
    cp4 = open_checkpoint((out / "checkpoint.note").read_text(), log.origin, log.public_key)
    manifest.update(entries=4, tree_size=4, root_hash=cp4.root_hash.hex())
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert run_verifier(out, "--vkey", log.verifier_key()).returncode == 0
    r = run_verifier(out, "--vkey", log.verifier_key(), "--trusted-checkpoint", str(held))
    assert r.returncode == 1 and "tail was removed" in r.stderr
    other = AuditLog(tmp_path / "o.db", signing_key=Ed25519PrivateKey.generate())
    r = run_verifier(out, "--vkey", other.verifier_key())
    assert r.returncode == 1 and "not signed by the trusted key" in r.stderr


def test_standalone_jcs_matches_rfc8785() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("verify_audit_mod", VERIFIER)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    import rfc8785

    samples = [{"\u20ac": 1, "\r": 2, "\ufb33": 3, "1": 4, "\U0001f600": 5, "\u0080": 6, "ö": 7},
               {"s": "".join(chr(c) for c in range(0, 0x80)) + "\u2028\u2029\ud7ff\ue000\U0010ffff"},
               [None, True, False, 0, -1, 2**53 - 1, -(2**53 - 1), "", [], {}, [[{"a": []}]]]]
    for s in samples:
        assert mod.jcs(s).encode() == rfc8785.dumps(s)


def test_cli_verify_show_prove(log: AuditLog, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    runner = CliRunner()
    db = log.url
    r = runner.invoke(app, ["audit", "verify", "--db", db])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["audit", "show", "--db", db, "--tail", "3"])
    assert r.exit_code == 0 and "datase" in r.output and "│ 9 " in r.output
    r = runner.invoke(app, ["audit", "prove", "3", "--db", db])
    proof = json.loads(r.output)
    assert proof["seq"] == 3 and proof["tree_size"] == 8
    r = runner.invoke(app, ["audit", "export", str(tmp_path / "e"), "--db", db])
    assert r.exit_code == 0 and (tmp_path / "e" / "manifest.json").exists()
    r = runner.invoke(app, ["audit", "verify", "--export", str(tmp_path / "e")])
    assert r.exit_code == 3 and "UNTRUSTED" in r.output, r.output  # only the export's own key: not verified
    (tmp_path / "held.pub").write_text(log.verifier_key())
    r = runner.invoke(app, ["audit", "verify", "--export", str(tmp_path / "e"), "--public-key", str(tmp_path / "held.pub")])
    assert r.exit_code == 0 and "UNTRUSTED" not in r.output, r.output
    raw_db(log).execute("UPDATE audit_entries SET outcome='failure' WHERE seq=2")
    r = runner.invoke(app, ["audit", "verify", "--db", db])
    assert r.exit_code == 1 and "seq=2" in r.output


def test_cli_show_prints_entry_fields_as_text_not_markup(log: AuditLog) -> None:
    """Entry fields are data: rich markup in them must print as written (and "[/x]" must not crash)."""
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    log.record("dataset.read", "dataset:[/x][bold]loud[/bold]")
    r = CliRunner().invoke(app, ["audit", "show", "--db", log.url, "--tail", "1"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "[/x]" in r.output and "loud" in r.output, r.output  # printed as written, not consumed as markup
    assert "server role" not in r.output  # SQLite entries carry no server view


def test_opening_a_missing_log_for_reading_fails_closed(tmp_path: Path) -> None:
    from securetrain.audit.errors import AuditConfigError

    missing = tmp_path / "nowhere" / "audit.db"
    with pytest.raises(AuditConfigError, match="no audit database"):
        AuditLog(missing, create=False)
    assert not missing.parent.exists()  # nothing was created that could later "verify"


def test_cli_never_creates_a_signing_key(log: AuditLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    runner = CliRunner()
    key_file = tmp_path / "data" / "audit_signing_key.pem"
    moved = tmp_path / "elsewhere.pem"
    key_file.rename(moved)
    monkeypatch.delenv("SECURETRAIN_AUDIT_KEY", raising=False)
    for args in (["audit", "verify"], ["audit", "pubkey"], ["audit", "checkpoint"], ["audit", "export", str(tmp_path / "x")]):
        r = runner.invoke(app, [*args, "--db", log.url])
        assert r.exit_code != 0 and "no audit signing key" in f"{r.exception} {r.output}", args
        assert not key_file.exists(), f"{args} created a fresh signing key"
    r = runner.invoke(app, ["audit", "verify", "--db", log.url, "--signing-key", str(moved)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["audit", "verify", "--db", log.url], env={"SECURETRAIN_AUDIT_KEY": str(moved)})
    assert r.exit_code == 0, r.output


def _append_in_child(log: AuditLog, n: int) -> None:
    for i in range(n):
        log.record("dicom.read", f"child:{i}", details={"n": i})


def test_a_log_sent_to_worker_processes_keeps_one_chain(log: AuditLog) -> None:
    import multiprocessing as mp
    import pickle

    ctx = mp.get_context("spawn")  # like DataLoader workers on macOS/Windows: a real pickle round trip
    procs = [ctx.Process(target=_append_in_child, args=(log, 5)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert log.size() == 10 + 15 and log.verify().ok
    clone = pickle.loads(pickle.dumps(log))
    assert clone.url == log.url and clone.size() == log.size()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from securetrain.audit.errors import AuditConfigError

    in_memory = AuditLog(log.url, signing_key=Ed25519PrivateKey.generate())
    with pytest.raises(AuditConfigError, match="in-memory signing key"):
        pickle.dumps(in_memory)


# -- review findings: unsigned tails, uncanonicalisable values ------------------------------------
def _append_forged_entry(out: Path) -> None:
    """An attacker appends a self-consistent, correctly chained entry that no checkpoint signs."""
    import rfc8785

    lines = (out / "entries.jsonl").read_bytes().splitlines()
    obj = json.loads(lines[-1])
    obj.update(seq=len(lines), prev_hash=canonical.sha256_hex(lines[-1]), actor="mallory", resource="dataset:phi")
    data = b"".join(line + b"\n" for line in lines) + rfc8785.dumps(obj) + b"\n"
    (out / "entries.jsonl").write_bytes(data)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["entries.jsonl"] = canonical.sha256_hex(data)
    (out / "manifest.json").write_text(json.dumps(manifest))


def _cli_verify_export(out: Path, *args: str):  # noqa: ANN202
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    if "--public-key" not in args:  # the key the auditor holds (a copy taken before any tampering)
        held = out.parent / "held-public-key.pem"
        if not held.exists():
            held.write_bytes((out / "public_key.pem").read_bytes())
        args = (*args, "--public-key", str(held))
    return CliRunner().invoke(app, ["audit", "verify", "--export", str(out), *args])


def test_export_with_an_unsigned_appended_entry_fails(log: AuditLog, tmp_path: Path) -> None:
    out = log.export(tmp_path / "exp")
    _append_forged_entry(out)
    r = run_verifier(out, "--vkey", log.verifier_key())
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "seq=10" in r.stderr and "not covered by a signed checkpoint" in r.stderr
    res = _cli_verify_export(out)
    assert res.exit_code == 1 and "not covered by a signed checkpoint" in res.output, res.output


def test_export_rebuilt_without_any_checkpoint_fails(log: AuditLog, tmp_path: Path) -> None:
    # A wholesale forged export: entries rebuilt and every checkpoint dropped. Nothing is signed,
    # so "verified" (exit 0) would be a lie even with the auditor's own --vkey.
    out = log.export(tmp_path / "exp")
    _tamper_line(out, 9, lambda ls, s: ls[:s])
    _append_forged_entry(out)
    (out / "checkpoints.note").write_text("")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["checkpoints.note"] = canonical.sha256_hex(b"")
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = run_verifier(out, "--vkey", log.verifier_key())
    assert r.returncode == 1 and "not covered by a signed checkpoint" in r.stderr, (r.stdout, r.stderr)
    assert _cli_verify_export(out).exit_code == 1


def test_empty_export_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "data"))
    lg = AuditLog(tmp_path / "empty.db", actor="alice")
    out = lg.export(tmp_path / "exp")
    r = run_verifier(out, "--vkey", lg.verifier_key())
    assert r.returncode == 0 and "OK: 0 entries" in r.stdout, (r.stdout, r.stderr)
    assert _cli_verify_export(out).exit_code == 0
    lg.close()


@pytest.mark.parametrize(
    "bad", [b'"rows":9007199254740992', b'"\\udc00":1,"rows":5', b'"rows":"\\ud800"', b'"rows":-9007199254740992'])
def test_uncanonicalisable_values_are_reported_as_tampering(log: AuditLog, tmp_path: Path, bad: bytes) -> None:
    from securetrain.audit.verify import records_from_jsonl, verify_records

    out = log.export(tmp_path / "exp")
    _tamper_line(out, 5, lambda ls, s: ls[:s] + [ls[s].replace(b'"rows":5', bad)] + ls[s + 1:])
    r = run_verifier(out, "--vkey", log.verifier_key())
    assert r.returncode == 1 and "seq=5" in r.stderr, (r.stdout, r.stderr)  # a verdict, not "unreadable input"
    with open(out / "entries.jsonl", "rb") as handle:
        report = verify_records(records_from_jsonl(handle), public_key=log.public_key,
                                checkpoint_notes=split_notes((out / "checkpoints.note").read_text()))
    assert not report.ok and report.error is not None and report.error.seq == 5


def test_database_edit_with_uncanonicalisable_details_is_reported(log: AuditLog) -> None:
    raw_db(log).execute("""UPDATE audit_entries SET details='{"rows":9007199254740993}' WHERE seq=3""")
    report = log.verify()  # must return a verdict, not raise rfc8785's IntegerDomainError
    assert not report.ok and report.error is not None and report.error.seq == 3


@pytest.mark.parametrize(
    ("resource", "details"),
    [("dataset:\ud800", None), ("r", {"name": "x\udfff"}), ("r", {"\udc00": 1}), ("r", {"a": ["\ud83d"]})])
def test_lone_surrogates_are_refused_with_a_typed_error(log: AuditLog, resource: str, details: dict | None) -> None:
    with pytest.raises(AuditEventError):
        log.record("dataset.read", resource, details=details)
    assert log.size() == 10


def test_writer_refuses_to_sign_a_history_rewritten_in_the_database(log: AuditLog, tmp_path: Path) -> None:
    # A database-only attacker (no signing key) rewrites entry 2 and re-chains everything after it,
    # then waits for the writer's next checkpoint to sign the forgery.
    signed = [c.tree_size for c in log.checkpoints()]
    assert signed == [4, 8]
    conn = raw_db(log)
    prev = canonical.GENESIS_HASH
    for e in list(log.entries()):
        resource = "dataset:innocent" if e.seq == 2 else e.resource
        obj = canonical.entry_object(seq=e.seq, ts=e.ts, actor=e.actor, hostname=e.hostname, mac=e.mac, action=e.action,
                                     resource=resource, outcome=e.outcome, details=e.details, prev_hash=prev)
        digest = canonical.sha256_hex(canonical.canonical_bytes(obj))
        conn.execute("UPDATE audit_entries SET resource=?, prev_hash=?, entry_hash=? WHERE seq=?",
                     (resource, prev, digest, e.seq))
        prev = digest
    conn.close()
    key_file = tmp_path / "writer.pem"
    from cryptography.hazmat.primitives import serialization

    key_file.write_bytes(log.signing_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    os.chmod(key_file, 0o600)
    fresh = AuditLog(log.url, actor="alice", signing_key=key_file, checkpoint_every=4)  # a new process: no cache
    fresh.record("dataset.read", "dataset:10")
    with pytest.raises(AuditIntegrityError):
        fresh.checkpoint()
    with pytest.raises(AuditIntegrityError):
        log.checkpoint()  # the long-running writer notices too (its cached tree disagrees)
    assert [c.tree_size for c in fresh.checkpoints()] == signed  # nothing new was signed
    fresh.close()


@pytest.mark.parametrize("stored", [
    '{"rows":0.5}',                # a float: the format stores floats as strings
    '{"rows":1e3}',                # an exponent
    '{ "rows":1}',                 # whitespace
    '{"z":1,"a":2}',               # keys out of order
    '{"name":"\\u00e9"}',          # an escape JCS does not use
    '{"rows":12345678901234567}',  # beyond 2^53-1
    '[1]',                         # not an object
])
def test_database_details_outside_the_canonical_form_are_reported(log: AuditLog, stored: str) -> None:
    """The verifier's fast path (C encoder) accepts only canonical, float-free details; the rest take the
    exact path, which reports them."""
    entry = list(log.entries())[3]
    new_hash = entry.entry_hash
    try:  # re-hashed where the value has a canonical form, so only the format check can catch it
        value = json.loads(stored)
        if isinstance(value, dict):
            new_hash = canonical.sha256_hex(canonical.canonical_bytes(entry.hashed_object() | {"details": value}))
    except AuditEventError:
        pass
    raw_db(log).execute("UPDATE audit_entries SET details=?, entry_hash=? WHERE seq=3", (stored, new_hash))
    report = log.verify()
    assert not report.ok and report.error is not None and report.error.seq == 3, report.error
    assert report.error.problem in {"details", "canonical"}  # the format check, not only a later checkpoint

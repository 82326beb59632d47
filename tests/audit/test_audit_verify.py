"""Verification of exports: pinned vs embedded keys, anchor files, checkpoint.note/manifest, fast path."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from securetrain.audit import canonical
from securetrain.audit.anchors import FileAnchor
from securetrain.audit.errors import AuditExportError
from securetrain.audit.export import verify_export
from securetrain.audit.log import AuditLog
from securetrain.audit.note import split_notes
from securetrain.audit.verify import check_entry, fast_accept
from securetrain.cli.main import app

REPO = Path(__file__).resolve().parents[2]
VERIFIER = REPO / "audit" / "verify_audit.py"


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AuditLog:
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path / "data"))
    lg = AuditLog(tmp_path / "audit.db", actor="alice", checkpoint_every=4, signing_key=Ed25519PrivateKey.generate(),
                  anchors=[FileAnchor(tmp_path / "audit-anchors.notes")])
    for i in range(10):
        lg.record("dataset.read", f"dataset:{i}", details={"rows": i, "sha256": "ab" * 32, "tags": ["x", None, True]})
    yield lg
    lg.close()


@pytest.fixture
def held_key(log: AuditLog, tmp_path: Path) -> Path:
    path = tmp_path / "held-verifier-key.txt"
    path.write_text(log.verifier_key() + "\n")
    return path


def cli(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, ["audit", *args])


def flat(result) -> str:  # noqa: ANN001
    """CLI output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def standalone(export: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", str(VERIFIER), str(export), *args],
                          capture_output=True, text=True, timeout=120)


def _refresh_manifest(out: Path, name: str) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][name] = canonical.sha256_hex((out / name).read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest))


def _forge_export(log: AuditLog, out: Path, tmp_path: Path) -> Path:
    """An attacker rebuilds the whole log with one entry changed and signs it with a fresh key."""
    forged = AuditLog(tmp_path / "forged.db", actor="alice", signing_key=Ed25519PrivateKey.generate(), checkpoint_every=4)
    for e in log.entries():
        forged.record(e.action, "dataset:innocent" if e.seq == 3 else e.resource, details=e.details)
    path = forged.export(out)
    forged.close()
    return path


# -- item: an export is trusted only with a key the auditor holds ----------------------------------
def test_cli_export_without_public_key_is_untrusted(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    out = log.export(tmp_path / "exp")
    r = cli("verify", "--export", str(out))
    assert r.exit_code == 3 and "UNTRUSTED" in flat(r), r.output
    assert cli("verify", "--export", str(out), "--trust-embedded-key").exit_code == 0
    r = cli("verify", "--export", str(out), "--public-key", str(held_key))
    assert r.exit_code == 0 and "UNTRUSTED" not in flat(r), r.output
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--json")
    assert json.loads(r.output)["trusted"] is True


def test_a_re_signed_forgery_is_only_self_consistent(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    forged = _forge_export(log, tmp_path / "forged", tmp_path)
    assert cli("verify", "--export", str(forged)).exit_code == 3  # was exit 0: "OK" for a forgery
    r = cli("verify", "--export", str(forged), "--public-key", str(held_key))
    assert r.exit_code == 1 and "not signed by the trusted key" in flat(r) or "trusted public key" in flat(r), r.output
    assert standalone(forged).returncode == 3
    assert standalone(forged, "--trust-embedded-key").returncode == 0
    r = standalone(forged, "--vkey", held_key.read_text().strip())
    assert r.returncode == 1 and "not signed by the trusted key" in r.stderr, r.stderr


def test_standalone_without_key_is_untrusted(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    out = log.export(tmp_path / "exp")
    r = standalone(out)
    assert r.returncode == 3 and "UNTRUSTED" in r.stdout + r.stderr, (r.stdout, r.stderr)
    r = standalone(out, "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["trusted"] is False
    r = standalone(out, "--vkey", str(held_key))
    assert r.returncode == 0 and "OK: 10 entries" in r.stdout, r.stderr
    assert standalone(out, "--public-key", str(out / "public_key.pem")).returncode == 0  # an explicit key is pinned


# -- item: anchor files, missing files, checkpoint.note and the manifest ---------------------------
def test_cli_checkpoint_accepts_an_anchor_file_of_many_notes(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    anchors = tmp_path / "audit-anchors.notes"
    assert len(split_notes(anchors.read_text())) == 2  # sizes 4 and 8
    r = cli("verify", "--db", log.url, "--checkpoint", str(anchors), "--public-key", str(held_key), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["trusted_verified"] == 2  # every note was checked, not only the first
    out = log.export(tmp_path / "exp")  # signs and anchors a third checkpoint (size 10)
    r = cli("verify", "--export", str(out), "--checkpoint", str(anchors), "--public-key", str(held_key), "--json")
    assert r.exit_code == 0 and json.loads(r.output)["trusted_verified"] == 3, r.output
    assert standalone(out, "--vkey", str(held_key), "--trusted-checkpoint", str(anchors)).returncode == 0
    assert standalone(out, "--vkey", str(held_key), "--checkpoint", str(anchors)).returncode == 0  # the CLI's spelling
    # The second held note altered: its signature no longer verifies.
    text = anchors.read_text()
    notes = split_notes(text)
    bad = notes[1].replace("\n8\n", "\n9\n")
    (tmp_path / "bad.notes").write_text(notes[0] + bad)
    r = cli("verify", "--export", str(out), "--checkpoint", str(tmp_path / "bad.notes"), "--public-key", str(held_key))
    assert r.exit_code == 1 and "does not verify" in flat(r), r.output
    assert standalone(out, "--vkey", str(held_key), "--checkpoint", str(tmp_path / "bad.notes")).returncode == 1


@pytest.mark.parametrize("missing", ["entries.jsonl", "manifest.json", "checkpoints.note", "checkpoint.note"])
def test_missing_export_file_is_a_clear_error(log: AuditLog, tmp_path: Path, held_key: Path, missing: str) -> None:
    out = log.export(tmp_path / "exp")
    (out / missing).unlink()
    r = cli("verify", "--export", str(out), "--public-key", str(held_key))
    assert r.exit_code == 2 and missing in flat(r) and "Traceback" not in flat(r), r.output
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit)
    with pytest.raises(AuditExportError, match=missing):
        verify_export(out)
    r = standalone(out, "--vkey", str(held_key))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert cli("verify", "--export", str(tmp_path / "nowhere"), "--public-key", str(held_key)).exit_code == 2


def test_stale_checkpoint_note_is_detected(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    out = log.export(tmp_path / "exp")
    older = split_notes((out / "checkpoints.note").read_text())[0]  # size 4, validly signed
    (out / "checkpoint.note").write_text(older)
    _refresh_manifest(out, "checkpoint.note")
    r = cli("verify", "--export", str(out), "--public-key", str(held_key))
    assert r.exit_code == 1 and "checkpoint.note" in flat(r), r.output
    r = standalone(out, "--vkey", str(held_key))
    assert r.returncode == 1 and "checkpoint.note" in r.stderr, r.stderr


@pytest.mark.parametrize(("field", "value"), [("root_hash", "00" * 32), ("tree_size", 9), ("entries", 11)])
def test_manifest_tree_is_checked(log: AuditLog, tmp_path: Path, held_key: Path, field: str, value: object) -> None:
    out = log.export(tmp_path / "exp")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest[field] = value
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = cli("verify", "--export", str(out), "--public-key", str(held_key))
    assert r.exit_code == 1 and "manifest.json" in flat(r), r.output
    r = standalone(out, "--vkey", str(held_key))
    assert r.returncode == 1 and "manifest.json" in r.stderr, r.stderr


def test_manifest_digest_of_entries_is_checked_by_the_cli(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    out = log.export(tmp_path / "exp")
    with open(out / "entries.jsonl", "ab") as handle:
        handle.write(b"")  # unchanged
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["entries.jsonl"] = "00" * 32
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = cli("verify", "--export", str(out), "--public-key", str(held_key))
    assert r.exit_code == 1 and "entries.jsonl" in flat(r), r.output


# -- item: --schema for PostgreSQL logs outside the default schema ---------------------------------
@pytest.mark.postgres
def test_cli_schema_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    psycopg = pytest.importorskip("psycopg")
    POSTGRES_URL = os.environ.get("SECURETRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    libpq = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    try:
        psycopg.connect(libpq, connect_timeout=3).close()
    except psycopg.OperationalError:
        pytest.skip("PostgreSQL not reachable")
    monkeypatch.setenv("SECURETRAIN_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SECURETRAIN_AUDIT_SCHEMA", raising=False)
    schema = f"st_audit_cli_{uuid.uuid4().hex[:10]}"
    key = Ed25519PrivateKey.generate()
    try:
        with AuditLog(POSTGRES_URL, schema=schema, actor="pg", signing_key=key, checkpoint_every=3) as lg:
            for i in range(7):
                lg.record("dataset.read", f"dataset:{i}")
            (tmp_path / "vk.txt").write_text(lg.verifier_key())
        pub = str(tmp_path / "vk.txt")
        r = cli("verify", "--db", POSTGRES_URL, "--schema", schema, "--public-key", pub, "--json")
        assert r.exit_code == 0 and json.loads(r.output)["entries"] == 7, r.output
        r = cli("show", "--db", POSTGRES_URL, "--schema", schema, "--tail", "2")
        assert r.exit_code == 0 and "│ 6 " in r.output and "│ 4 " not in r.output, r.output
        r = cli("prove", "2", "--db", POSTGRES_URL, "--schema", schema)
        assert r.exit_code == 0 and json.loads(r.output)["seq"] == 2, r.output
        monkeypatch.setenv("SECURETRAIN_AUDIT_SCHEMA", schema)
        assert cli("verify", "--db", POSTGRES_URL, "--public-key", pub).exit_code == 0
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- the fast path accepts exactly what the exact check accepts ------------------------------------
_CHARS = ["a", "Z", "0", " ", '"', "\\", "/", "\x00", "\x01", "\x07", "\x08", "\t", "\n", "\x0b", "\x0c", "\r", "\x1f",
          "\x7f", "\x80", "é", "\u2028", "\ud7ff", "\ue000", "\uffff", "\U0001f600", "\U0010ffff", "€"]


def _rand_str(rng: random.Random) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randrange(0, 6)))


def _rand_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind in (1, 2):
        return rng.choice([0, 1, -1, 2**53 - 1, -(2**53 - 1), rng.randrange(-10**6, 10**6)])
    if kind in (3, 4):
        return _rand_str(rng)
    if kind == 5:
        return [_rand_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {_rand_str(rng): _rand_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _entry(rng: random.Random, seq: int, prev: str, *, with_view: bool = False) -> bytes:
    details = {_rand_str(rng) or "k": _rand_value(rng) for _ in range(rng.randrange(4))}
    view = None
    if with_view:  # PostgreSQL: the server's view (role, client address or null, time)
        view = {"role": _rand_str(rng), "addr": rng.choice([None, "127.0.0.1", "::1", _rand_str(rng)]),
                "time": rng.choice(["2026-01-01T00:00:00.000001Z", _rand_str(rng)])}
    obj = canonical.entry_object(seq=seq, ts="2026-01-01T00:00:00.000000Z", actor=_rand_str(rng), hostname="h",
                                 mac="aa:bb:cc:dd:ee:ff", action="a.b", resource=_rand_str(rng), outcome="success",
                                 details=details, prev_hash=prev, server_view=view)
    return rfc8785.dumps(obj)


def _standalone_module():  # noqa: ANN202
    import importlib.util

    spec = importlib.util.spec_from_file_location("verify_audit_fast", VERIFIER)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


FAST_PATHS = {"library": fast_accept, "standalone": _standalone_module().fast_ok}


@pytest.mark.parametrize("with_view", [False, True])
@pytest.mark.parametrize("impl", sorted(FAST_PATHS))
def test_fast_path_agrees_with_rfc8785(impl: str, with_view: bool) -> None:
    fast_accept = FAST_PATHS[impl]
    rng = random.Random(20261204)
    prev = "ab" * 32
    accepted = 0
    for seq in range(3000):
        raw = _entry(rng, seq, prev, with_view=with_view)
        has_astral = any(ord(c) > 0xFFFF for c in raw.decode())
        ok = fast_accept(raw, seq, prev)
        assert ok or has_astral, raw  # every canonical line without astral characters is accepted fast
        accepted += ok
        assert not fast_accept(raw, seq + 1, prev) and not fast_accept(raw, seq, "cd" * 32)
        # Any non-canonical variant must never be accepted by the fast path.
        obj = json.loads(raw)
        for variant in (json.dumps(obj).encode(), json.dumps(obj, separators=(",", ":")).encode(),
                        json.dumps(obj, separators=(",", ":"), sort_keys=True).encode(),
                        raw.replace(b'"v":1}', b'"v":1.0}'), raw.replace(b'"seq":', b'"seq":0', 1),
                        raw + b" ", raw.replace(b'{"action"', b'{"action":"x","action"', 1),
                        raw.replace(b'"server_view":{"addr":', b'"server_view":{"addr" :', 1)):
            if variant != raw:
                assert not fast_accept(variant, seq, prev), variant
    assert accepted > (900 if with_view else 1000)  # the rest hold characters beyond U+FFFF: exact path


@pytest.mark.parametrize("details", [
    b'{"a":1.5}', b'{"a":1e5}', b'{"a":NaN}', b'{"a":9007199254740992}', b'{"a":-0}', b'{"b":1,"a":2}',
    b'{"a":1,"a":1}', b'{"a":"\\u0041"}', b'{"a":"\\/"}', b'{"a":"\\ud800"}', b'{"a":"\\u001F"}', b'{ "a":1}',
    b'{"a":[1 ,2]}', b'{"a":"\x01"}'])
@pytest.mark.parametrize("impl", sorted(FAST_PATHS))
def test_fast_path_refuses_non_canonical_details(details: bytes, impl: str) -> None:
    fast_accept = FAST_PATHS[impl]
    prev = "00" * 32
    good = rfc8785.dumps(canonical.entry_object(seq=0, ts="t", actor="a", hostname="h", mac="m", action="a",
                                                resource="r", outcome="success", details={"a": 1}, prev_hash=prev))
    assert fast_accept(good, 0, prev)
    assert not fast_accept(good.replace(b'"details":{"a":1}', b'"details":' + details), 0, prev)


@pytest.mark.parametrize("impl", sorted(FAST_PATHS))
@pytest.mark.parametrize("details", [{"a": {"b": 1}, "hostname": "x"}, {"a": '},"hostname":"'}, {}, {"x": {}},
                                     {"hostname": {"mac": "m"}, "v": 1}])
def test_fast_path_accepts_details_that_look_like_the_top_level(details: dict, impl: str) -> None:
    prev = "00" * 32
    raw = rfc8785.dumps(canonical.entry_object(seq=7, ts="t", actor="a", hostname="h", mac="m", action="a",
                                               resource="r", outcome="success", details=details, prev_hash=prev))
    assert FAST_PATHS[impl](raw, 7, prev)


EXACT_CHECKS = {"library": lambda raw, seq, prev: check_entry(raw, json.loads(raw), seq, prev),
                "standalone": _standalone_module().exact_check}


@pytest.mark.parametrize("impl", sorted(FAST_PATHS))
@pytest.mark.parametrize("view", [
    {"role": "w", "addr": "127.0.0.1"}, {"role": "w", "addr": None, "time": "t", "actor": "x"}, [],
    {"role": None, "addr": None, "time": "t"}, {"role": "w", "addr": 127, "time": "t"},
    {"role": "w", "addr": None, "time": 1}, {"role": "w", "addr": {"ip": "x"}, "time": "t"}])
def test_malformed_server_view_is_refused_by_both_verifiers(impl: str, view: object) -> None:
    prev = "00" * 32
    kwargs = {"seq": 0, "ts": "t", "actor": "a", "hostname": "h", "mac": "m", "action": "a", "resource": "r",
              "outcome": "success", "details": {}, "prev_hash": prev}
    good = rfc8785.dumps(canonical.entry_object(**kwargs, server_view={"role": "w", "addr": None, "time": "t"}))
    assert FAST_PATHS[impl](good, 0, prev)
    EXACT_CHECKS[impl](good, 0, prev)
    obj = {**canonical.entry_object(**kwargs), "server_view": view}
    raw = rfc8785.dumps(obj)  # canonical JSON, but not a server view
    assert not FAST_PATHS[impl](raw, 0, prev)
    with pytest.raises(Exception, match="server_view"):
        EXACT_CHECKS[impl](raw, 0, prev)


# -- incremental verification from a held checkpoint ---------------------------------------------
def _grow(log: AuditLog, n: int) -> None:
    for i in range(n):
        log.record("dataset.read", f"dataset:new-{i}", details={"rows": i})


@pytest.mark.parametrize("held_size_target", [4, 8, 10])
def test_incremental_verification_from_a_held_checkpoint(log: AuditLog, tmp_path: Path, held_key: Path,
                                                         held_size_target: int) -> None:
    first = log.export(tmp_path / "day1")
    notes = {int(n.split("\n")[1]): n for n in split_notes((first / "checkpoints.note").read_text())}
    held = tmp_path / "held.note"
    held.write_text(notes[held_size_target])
    _grow(log, 10)
    out = log.export(tmp_path / "day2")
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--since-checkpoint", str(held), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["entries"] == 20
    r = standalone(out, "--vkey", str(held_key), "--since-checkpoint", str(held), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["entries"] == 20, (r.stdout, r.stderr)
    # A new entry edited: found, with its seq.
    lines = (out / "entries.jsonl").read_bytes().splitlines(keepends=True)
    lines[15] = lines[15].replace(b'"actor":"alice"', b'"actor":"mallory"')
    (out / "entries.jsonl").write_bytes(b"".join(lines))
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--since-checkpoint", str(held))
    assert r.exit_code == 1 and "seq=15" in flat(r), r.output
    r = standalone(out, "--vkey", str(held_key), "--since-checkpoint", str(held))
    assert r.returncode == 1 and "seq=15" in r.stderr, r.stderr


def test_incremental_verification_detects_a_rewritten_past(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    first = log.export(tmp_path / "day1")
    held = tmp_path / "held.note"
    held.write_text((first / "checkpoint.note").read_text())  # size 10
    _grow(log, 5)
    out = log.export(tmp_path / "day2")
    # The old entry 9 (last before the held size) is edited: the chain head is re-derived from it.
    lines = (out / "entries.jsonl").read_bytes().splitlines(keepends=True)
    lines[9] = lines[9].replace(b'"actor":"alice"', b'"actor":"mallory"')
    (out / "entries.jsonl").write_bytes(b"".join(lines))
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--since-checkpoint", str(held))
    assert r.exit_code == 1 and "held checkpoint" in flat(r), r.output
    r = standalone(out, "--vkey", str(held_key), "--since-checkpoint", str(held))
    assert r.returncode == 1 and "held checkpoint" in r.stderr, r.stderr
    # A forged compact range (peaks of another tree) is refused.
    ranges = (out / "ranges.jsonl").read_text().splitlines()
    forged = [json.dumps({**json.loads(x), "peaks": ["11" * 32] * len(json.loads(x)["peaks"])}) for x in ranges]
    (out / "ranges.jsonl").write_text("\n".join(forged) + "\n")
    _refresh_manifest(out, "ranges.jsonl")  # the manifest is no trust anchor: the attacker fixes it
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--since-checkpoint", str(held))
    assert r.exit_code == 1 and "compact range" in flat(r), r.output
    r = standalone(out, "--vkey", str(held_key), "--since-checkpoint", str(held))
    assert r.returncode == 1 and "compact range" in r.stderr, r.stderr
    # A held note signed by another key is refused.
    other = AuditLog(tmp_path / "o.db", signing_key=Ed25519PrivateKey.generate())
    other.record("a.b", "r")
    (tmp_path / "other.note").write_text(other.checkpoint().note)
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--since-checkpoint", str(tmp_path / "other.note"))
    assert r.exit_code == 1, r.output
    other.close()


# -- proofs from `securetrain audit prove`, checked by the standalone verifier -------------------
def test_standalone_checks_prove_output(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    r = cli("prove", "5", "--db", log.url)
    assert r.exit_code == 0, r.output
    proof = json.loads(r.output)
    assert proof["tree_size"] == 8 and "checkpoint" in proof
    good = tmp_path / "proof.json"
    good.write_text(r.output)
    res = standalone(Path(""), "--proof", str(good), "--vkey", str(held_key))
    assert res.returncode == 0, (res.stdout, res.stderr)
    for field, value in (("entry", proof["entry"].replace("dataset:5", "dataset:6")), ("leaf_index", 4),
                         ("proof", list(reversed(proof["proof"]))), ("tree_size", 9)):
        (tmp_path / "bad.json").write_text(json.dumps({**proof, field: value}))
        res = standalone(Path(""), "--proof", str(tmp_path / "bad.json"), "--vkey", str(held_key))
        assert res.returncode == 1, (field, res.stdout, res.stderr)
    other = AuditLog(tmp_path / "o.db", signing_key=Ed25519PrivateKey.generate())
    res = standalone(Path(""), "--proof", str(good), "--vkey", other.verifier_key())
    assert res.returncode == 1 and "not signed by the trusted key" in res.stderr
    other.close()
    # Consistency: from the held size-4 checkpoint to the size-8 one.
    r = cli("prove", "--consistency", "4", "--size", "8", "--db", log.url)
    assert r.exit_code == 0, r.output
    cons = tmp_path / "cons.json"
    cons.write_text(r.output)
    held = tmp_path / "held.note"
    held.write_text(split_notes((tmp_path / "audit-anchors.notes").read_text())[0])  # size 4
    res = standalone(Path(""), "--proof", str(cons), "--vkey", str(held_key), "--trusted-checkpoint", str(held))
    assert res.returncode == 0, (res.stdout, res.stderr)
    data = json.loads(r.output)
    (tmp_path / "bad.json").write_text(json.dumps({**data, "old_root": "00" * 32}))
    res = standalone(Path(""), "--proof", str(tmp_path / "bad.json"), "--vkey", str(held_key))
    assert res.returncode == 1 and "does not verify" in res.stderr, res.stderr
    (tmp_path / "bad.json").write_text(json.dumps({**data, "old_size": 0, "proof": []}))
    res = standalone(Path(""), "--proof", str(tmp_path / "bad.json"), "--vkey", str(held_key))
    assert res.returncode == 1  # a proof from the empty tree proves nothing


# -- parallel verification: same verdicts as sequential ------------------------------------------
@pytest.mark.parametrize("tamper", [None, 0, 3, 9, 12, 27, "truncate", "swap", "blank"])
def test_parallel_verification_matches_sequential(log: AuditLog, tmp_path: Path, held_key: Path, tamper) -> None:  # noqa: ANN001
    _grow(log, 20)
    out = log.export(tmp_path / "exp")
    lines = (out / "entries.jsonl").read_bytes().splitlines(keepends=True)
    if isinstance(tamper, int):
        lines[tamper] = lines[tamper].replace(b'"outcome":"success"', b'"outcome":"failure"')
    elif tamper == "truncate":
        lines = lines[:17]
    elif tamper == "swap":
        lines[12], lines[13] = lines[13], lines[12]
    elif tamper == "blank":
        lines.insert(11, b"\n")
    (out / "entries.jsonl").write_bytes(b"".join(lines))
    if tamper is not None:
        _refresh_manifest(out, "entries.jsonl")
    from securetrain.audit.keys import load_public_key_pem

    key = load_public_key_pem((out / "public_key.pem").read_bytes())
    seq = verify_export(out, public_key=key, workers=1)
    one = standalone(out, "--vkey", str(held_key), "--workers", "1")
    for chunk in ("97", "700"):
        two = standalone(out, "--vkey", str(held_key), "--workers", "2", "--chunk-bytes", chunk)
        assert (two.returncode, two.stdout, two.stderr) == (one.returncode, one.stdout, one.stderr), chunk
    assert one.returncode == (0 if tamper is None else 1), one.stderr
    for chunk in (97, 500, 1 << 20):
        par = verify_export(out, public_key=key, workers=2, chunk_bytes=chunk)
        assert (par.ok, par.entries, par.root_hash, par.checkpoints_verified) == \
            (seq.ok, seq.entries, seq.root_hash, seq.checkpoints_verified), chunk
        assert str(par.error) == str(seq.error), chunk
    assert seq.ok is (tamper is None)
    r = cli("verify", "--export", str(out), "--public-key", str(held_key), "--workers", "2", "--json")
    assert r.exit_code == (0 if tamper is None else 1) and json.loads(r.output)["root_hash"] == seq.root_hash, r.output


@pytest.mark.parametrize("tamper", [None, 9])
def test_parallel_verification_survives_dead_workers(log: AuditLog, tmp_path: Path, held_key: Path,
                                                     monkeypatch: pytest.MonkeyPatch, tamper) -> None:  # noqa: ANN001
    """Workers that die (here: cannot even start) change nothing but the speed: every range is re-checked here."""
    import importlib.util

    _grow(log, 20)
    out = log.export(tmp_path / "exp")
    if tamper is not None:
        lines = (out / "entries.jsonl").read_bytes().splitlines(keepends=True)
        lines[tamper] = lines[tamper].replace(b'"outcome":"success"', b'"outcome":"failure"')
        (out / "entries.jsonl").write_bytes(b"".join(lines))
        _refresh_manifest(out, "entries.jsonl")
    from securetrain.audit.keys import load_public_key_pem

    key = load_public_key_pem((out / "public_key.pem").read_bytes())
    seq = verify_export(out, public_key=key, workers=1)
    spec = importlib.util.spec_from_file_location("verify_audit_dead_workers", VERIFIER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    one = module.main([str(out), "--vkey", str(held_key), "--workers", "1", "--json"])
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every worker exits at once, printing nothing
    par = verify_export(out, public_key=key, workers=2, chunk_bytes=500)
    assert (par.ok, par.entries, par.root_hash, str(par.error)) == (seq.ok, seq.entries, seq.root_hash, str(seq.error))
    assert seq.ok is (tamper is None) and (tamper is None or (par.error is not None and par.error.seq == tamper + 1))  # the chain breaks at the next entry
    assert any("worker process failed" in w for w in par.warnings)
    two = module.main([str(out), "--vkey", str(held_key), "--workers", "2", "--chunk-bytes", "500", "--json"])
    assert two == one == (0 if tamper is None else 1)


@pytest.mark.parametrize("details,ok", [
    ('{"a":9007199254740991,"b":-9007199254740991}', True),
    ('{"a":9007199254740992}', False),
    ('{"a":-9007199254740992}', False),
    ('{"a":[9007199254740992]}', False),
    ('{"a":{"b":-9007199254740992}}', False),
    ('{"a":[1],"b":9007199254740992}', False),
    ('{"b":9007199254740992,"c":[1]}', False),
    ('{"a":[1,{"b":123456789012345}],"c":true,"d":null}', True),
    ('{"a":1.5}', False),
    ('{"a":1e3}', False),
])
def test_fast_path_integer_range(details: str, ok: bool) -> None:
    """The fast path checks flat details' integers itself and nested ones with the hooked scanner."""
    from securetrain.audit import verify as library

    assert library._details_canonical(details) is ok
    assert _standalone_module().details_canonical(details) is ok


def test_standalone_proof_checks_every_held_checkpoint(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    """A held checkpoint passed with an inclusion proof is checked, never silently ignored (it used to be)."""
    r = cli("prove", "5", "--db", log.url)
    assert r.exit_code == 0, r.output
    proof = tmp_path / "proof.json"
    proof.write_text(r.output)
    assert json.loads(r.output)["tree_size"] == 8
    size4, size8 = split_notes((tmp_path / "audit-anchors.notes").read_text())[:2]
    (tmp_path / "held8.note").write_text(size8)
    res = standalone(Path(""), "--proof", str(proof), "--vkey", str(held_key), "--trusted-checkpoint",
                     str(tmp_path / "held8.note"))
    assert res.returncode == 0, (res.stdout, res.stderr)
    (tmp_path / "held4.note").write_text(size4)  # signed and authentic, but not the proven tree
    res = standalone(Path(""), "--proof", str(proof), "--vkey", str(held_key), "--trusted-checkpoint",
                     str(tmp_path / "held4.note"))
    assert res.returncode == 1 and "not an end of this proof" in res.stderr and "--size 4" in res.stderr, res.stderr
    (tmp_path / "garbage.note").write_text("not a note\n")
    res = standalone(Path(""), "--proof", str(proof), "--vkey", str(held_key), "--trusted-checkpoint",
                     str(tmp_path / "garbage.note"))
    assert res.returncode == 1, (res.stdout, res.stderr)
    res = standalone(Path(""), "--proof", str(proof), "--vkey", str(held_key), "--trusted-checkpoint",
                     str(tmp_path / "missing.note"))
    assert res.returncode == 2 and "missing.note" in res.stderr, res.stderr
    other = AuditLog(tmp_path / "o.db", signing_key=Ed25519PrivateKey.generate())
    other.record("a.b", "r")
    (tmp_path / "other.note").write_text(other.checkpoint().note)
    other.close()
    res = standalone(Path(""), "--proof", str(proof), "--vkey", str(held_key), "--trusted-checkpoint",
                     str(tmp_path / "other.note"))
    assert res.returncode == 1, (res.stdout, res.stderr)


@pytest.mark.parametrize("mode", ["export", "proof"])
def test_standalone_refuses_a_held_checkpoint_file_without_a_note(log: AuditLog, tmp_path: Path, held_key: Path,
                                                                  mode: str) -> None:
    """An empty held-checkpoint file is a failure (as in `securetrain audit verify`), not a skipped anchor."""
    (tmp_path / "empty.note").write_text("\n")
    if mode == "export":
        target, extra = log.export(tmp_path / "exp"), []
    else:
        r = cli("prove", "--consistency", "4", "--size", "8", "--db", log.url)
        (tmp_path / "cons.json").write_text(r.output)
        target, extra = Path(""), ["--proof", str(tmp_path / "cons.json")]
    res = standalone(target, *extra, "--vkey", str(held_key), "--trusted-checkpoint", str(tmp_path / "empty.note"))
    assert res.returncode == 1 and "no checkpoint note" in res.stderr, (res.stdout, res.stderr)


def test_standalone_missing_vkey_file_is_unreadable_input(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    """`--vkey FILE` naming a file that does not exist is unreadable input (exit 2, the file named), as
    with --public-key and `securetrain audit verify`; it used to be parsed as a key and fail with
    exit 1 ("verifier key must look like …"), which reads as a failed verification."""
    out = log.export(tmp_path / "exp")
    missing = tmp_path / "verifier-key.txt"
    res = standalone(out, "--vkey", str(missing))
    assert res.returncode == 2 and "verifier-key.txt" in res.stderr, (res.returncode, res.stderr)
    (tmp_path / "cp.json").write_text(cli("prove", "1", "--db", log.url).output)
    res = standalone(Path(""), "--proof", str(tmp_path / "cp.json"), "--vkey", str(missing))
    assert res.returncode == 2 and "verifier-key.txt" in res.stderr, (res.returncode, res.stderr)
    assert standalone(out, "--vkey", log.verifier_key()).returncode == 0  # a literal key still works
    assert standalone(out, "--vkey", str(held_key)).returncode == 0
    res = standalone(out, "--vkey", "garbage+1234+AAAA")
    assert res.returncode == 1, res.stderr  # a malformed literal key is still a verification failure


# -- the same entry failure is worded the same by `audit verify` and the standalone verifier -------
def _edit(field: str, value: object):  # noqa: ANN202
    def fn(line: bytes) -> bytes:
        obj = json.loads(line)
        if value is _DROP:
            del obj[field]
        else:
            obj[field] = value
        return rfc8785.dumps(obj) + b"\n"
    return fn


_DROP = object()
_ENTRY_TAMPERS = {
    "json": lambda line: b"{not json\n",
    "fields": _edit("hostname", _DROP),
    "version": _edit("v", 2),
    "seq-type": _edit("seq", "5"),
    "seq": _edit("seq", 6),
    "type": _edit("actor", 5),
    "details-type": _edit("details", [1]),
    "float": lambda line: line.replace(b'"rows":5', b'"rows":5.5'),
    "server-view": _edit("server_view", {"role": 1}),
    "not-canonical": lambda line: line.replace(b'","', b'", "', 1),
    "big-int": lambda line: line.replace(b'"rows":5', b'"rows":9007199254740993'),
    "prev-hash": _edit("actor", "mallory"),  # entry 5 re-canonical: entry 6's prev_hash breaks
    "long-line": lambda line: line.replace(b'"rows":5', b'"rows":5,"x":"' + b"a" * (3 << 20) + b'"'),
}


def _rewrite_history(lines: list[bytes]) -> list[bytes]:
    """Entry 2 edited and every later entry re-chained: only the checkpoints can tell."""
    out, prev = lines[:2], canonical.sha256_hex(lines[1].rstrip(b"\n"))
    for i, line in enumerate(lines[2:], start=2):
        obj = json.loads(line)
        obj["actor"] = "mallory" if i == 2 else obj["actor"]
        obj["prev_hash"] = prev
        raw = rfc8785.dumps(obj)
        out.append(raw + b"\n")
        prev = canonical.sha256_hex(raw)
    return out


_LOG_TAMPERS = {"truncate": lambda lines: lines[:7], "rewrite-history": _rewrite_history}


@pytest.mark.parametrize("tamper", sorted(_ENTRY_TAMPERS) + sorted(_LOG_TAMPERS))
def test_entry_failures_are_worded_alike_by_both_verifiers(log: AuditLog, tmp_path: Path, held_key: Path,
                                                           tamper: str) -> None:
    """Found by review: the two verifiers named the same broken entry differently ("not valid JSON" /
    "line is not valid JSON", "a field has the wrong type" / "actor is not a string", ...). An auditor
    comparing the two reports must read the same sentence."""
    out = log.export(tmp_path / "exp")
    lines = (out / "entries.jsonl").read_bytes().splitlines(keepends=True)
    if tamper in _LOG_TAMPERS:
        lines = _LOG_TAMPERS[tamper](lines)
    else:
        lines[5] = _ENTRY_TAMPERS[tamper](lines[5])
    (out / "entries.jsonl").write_bytes(b"".join(lines))
    _refresh_manifest(out, "entries.jsonl")
    mine = cli("verify", "--export", str(out), "--public-key", str(held_key))
    theirs = standalone(out, "--vkey", str(held_key))
    assert mine.exit_code == 1 and theirs.returncode == 1, (mine.output, theirs.stderr)
    said = flat(mine)
    assert "FAILED: entry seq=" in said, said
    mine_text = said[said.index("FAILED: "):]
    theirs_text = " ".join(theirs.stderr.split())
    assert mine_text == theirs_text, (tamper, mine_text, theirs_text)


# -- `audit prove`: the size proven against, the log's size, and size 0 ---------------------------
def _said(r) -> str:  # noqa: ANN001
    """What a failed command told the user: its output and its typed error (printed by the root CLI)."""
    return " ".join(f"{r.output} {r.exception or ''}".split())


def test_prove_names_the_size_proven_against_and_the_log_size(log: AuditLog) -> None:
    """Found by review: with --size N the errors called N the log's size ("entry 9 is not in a tree of
    size 8 (log has 8 entries)" for a log of 10). N is the size proven against; the log's real size is
    said where it differs, and printed in the proof as log_size."""
    r = cli("prove", "5", "--size", "8", "--db", log.url)
    assert r.exit_code == 0, r.output
    proof = json.loads(r.output)
    assert proof["tree_size"] == 8 and proof["log_size"] == 10
    for args in (("9", "--size", "8"), ("--consistency", "9", "--size", "8")):
        r = cli("prove", *args, "--db", log.url)
        text = _said(r)
        assert r.exit_code != 0 and "{" not in r.output, text
        assert "tree size 8 (the size proven against)" in text and "the log has 10 entries" in text, text
        assert "log has 8" not in text, text
    r = cli("prove", "3", "--size", "50", "--db", log.url)
    text = _said(r)
    assert r.exit_code != 0 and "tree size 50 (the size proven against)" in text, text
    assert "the log has only 10 entries" in text, text


@pytest.mark.parametrize("old", ["0", "-1"])
def test_prove_consistency_from_size_0_is_refused_up_front(tmp_path: Path, old: str) -> None:
    """RFC 6962 has no consistency proof from the empty tree (it would prove nothing, and the
    standalone verifier rejects it): refused before the log is even opened, saying why."""
    r = cli("prove", "--consistency", old, "--db", f"sqlite:///{tmp_path}/no/such/dir/audit.db")
    text = _said(r)
    assert r.exit_code != 0 and "{" not in r.output, text
    assert "--consistency" in text and "RFC 6962" in text and "at least 1" in text, text
    assert "no/such/dir" not in text, text  # refused before the database was looked at


def test_standalone_proof_result_says_what_was_checked(log: AuditLog, tmp_path: Path, held_key: Path) -> None:
    """Found by review: `verify_audit.py --proof` printed "OK: 8 entries verified" for a proof, which
    verifies one entry's inclusion (or that the log only grew), not 8 entries."""
    (tmp_path / "inc.json").write_text(cli("prove", "5", "--db", log.url).output)
    (tmp_path / "cons.json").write_text(cli("prove", "--consistency", "4", "--size", "8", "--db", log.url).output)
    res = standalone(Path(""), "--proof", str(tmp_path / "inc.json"), "--vkey", str(held_key))
    assert res.returncode == 0 and "entries verified" not in res.stdout, res.stdout
    assert res.stdout.startswith("OK: verified that entry 5 is in the signed tree of 8 entries, root"), res.stdout
    res = standalone(Path(""), "--proof", str(tmp_path / "cons.json"), "--vkey", str(held_key))
    assert res.returncode == 0 and "entries verified" not in res.stdout, res.stdout
    assert res.stdout.startswith("OK: verified that the tree of 4 entries is a prefix of the signed tree of 8 "
                                 "entries (the log only grew), root"), res.stdout
    res = standalone(Path(""), "--proof", str(tmp_path / "inc.json"), "--vkey", str(held_key), "--json")
    result = json.loads(res.stdout)
    assert result["entries"] is None and result["proof"] == {"kind": "inclusion", "leaf_index": 5, "tree_size": 8}
    html = tmp_path / "r.html"
    standalone(Path(""), "--proof", str(tmp_path / "cons.json"), "--vkey", str(held_key), "--html", str(html))
    assert "Entries:" not in html.read_text() and "the tree of 4 entries is a prefix" in html.read_text()


# -- a database is verified row by row through the writer's template, exactly as the slow path -----
def _exact_report(log: AuditLog):  # noqa: ANN202
    """The reference: every row parsed, rebuilt and re-encoded (the path before the template)."""
    from securetrain.audit.verify import verify_records

    rows = [r[-1] for batch in log._row_batches() for r in batch]
    with log._read_engine.connect() as conn:
        notes = [r[0] for r in conn.exec_driver_sql("SELECT note FROM audit_checkpoints ORDER BY tree_size")]
    return verify_records([log._record_from_row(r) for r in rows], public_key=log.public_key, checkpoint_notes=notes)


def _tampered_copy(src: Path, dst: Path, rng: random.Random) -> str:
    """A copy of the database with one random change made by someone with file access (triggers
    dropped); where the change keeps a row parseable, its entry_hash is recomputed the way a forger
    would (from the new row, through the writer's template)."""
    import hashlib
    import shutil
    import sqlite3

    from securetrain.audit.triggers import SQLITE_TRIGGER_NAMES

    shutil.copy(src, dst)
    conn = sqlite3.connect(dst, isolation_level=None)
    for name in SQLITE_TRIGGER_NAMES:
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    n = conn.execute("SELECT COUNT(*) FROM audit_entries").fetchone()[0]
    seq = rng.randrange(n)
    kind = rng.choice(["details-spaced", "details-float", "details-astral-keys", "resource", "blob-actor", "delete",
                       "seq", "prev", "hash", "details-dup-keys", "ts-int"])
    updates = {
        "details-spaced": ("details", '{"rows": 1}'),
        "details-float": ("details", '{"rows":1.5}'),
        "details-astral-keys": ("details", '{"\U0001f600":1,"\ue000":2}'),
        "details-dup-keys": ("details", '{"a":1,"a":2}'),
        "resource": ("resource", "dataset:forged"),
        "blob-actor": ("actor", b"\x00\xff"),
        "prev": ("prev_hash", "0" * 64),
        "hash": ("entry_hash", "f" * 64),
        "ts-int": ("ts", 5),
    }
    if kind == "delete":
        conn.execute("DELETE FROM audit_entries WHERE seq = ?", (seq,))
    elif kind == "seq":
        conn.execute("UPDATE audit_entries SET seq = ? WHERE seq = ?", (n + 5, seq))
    else:
        column, value = updates[kind]
        conn.execute(f"UPDATE audit_entries SET {column} = ? WHERE seq = ?", (value, seq))  # noqa: S608
        if kind != "hash":
            row = conn.execute("SELECT seq, ts, actor, hostname, mac, action, resource, outcome, details, prev_hash "
                               "FROM audit_entries WHERE seq = ?", (seq,)).fetchone()
            try:
                raw = canonical.entry_bytes(seq=row[0], ts=row[1], actor=row[2], hostname=row[3], mac=row[4],
                                            action=row[5], resource=row[6], outcome=row[7], details_json=row[8],
                                            prev_hash=row[9])
                conn.execute("UPDATE audit_entries SET entry_hash = ? WHERE seq = ?",
                             (hashlib.sha256(raw).hexdigest(), seq))
            except (TypeError, canonical.AuditEventError):
                pass
    conn.close()
    return f"{kind}@{seq}"


def test_database_verification_agrees_with_the_exact_path(tmp_path: Path) -> None:
    """Sound entries with every kind of text (control characters, U+2028, characters beyond
    U+FFFF in keys and values) verify; and for each random tampering the report (ok, error) is the
    one the exact path gives."""
    rng = random.Random(20261205)
    src = tmp_path / "src.db"
    log = AuditLog(src, actor="alice", checkpoint_every=7, signing_key=Ed25519PrivateKey.generate())
    written = 0
    while written < 40:
        details = {_rand_str(rng) or "k": _rand_value(rng) for _ in range(rng.randrange(4))}
        try:
            log.record("dataset.read", _rand_str(rng) or "r", details=details)
        except canonical.AuditEventError:  # e.g. a key the details rules refuse
            continue
        written += 1
    fast, exact = log.verify(), _exact_report(log)
    assert fast.ok and exact.ok and fast.entries == exact.entries == log.size() and fast.root_hash == exact.root_hash
    key = log.signing_key
    log.close()
    for trial in range(30):
        dst = tmp_path / f"t{trial}.db"
        what = _tampered_copy(src, dst, rng)
        forged = AuditLog(dst, actor="alice", checkpoint_every=None, signing_key=key, create=False)
        fast, exact = forged.verify(), _exact_report(forged)
        assert (fast.ok, str(fast.error), fast.entries) == (exact.ok, str(exact.error), exact.entries), what
        forged.close()

"""Audit-log verification speed and memory, against raw hashlib measured in the same run.

    python benchmarks/audit_verify.py [--quick] [--entries N]

Builds a signed export of N entries (default 100,000; --quick 20,000) shaped like the training
hot path (``dicom.read`` with a SHA-256 and ids in ``details``, checkpoint every 1,000 entries), then:

* ``securetrain audit verify --export`` (the library's ``verify_export``) in a child process,
* the standalone ``audit/verify_audit.py`` in a child process (``python -I``),

each with 1 and 2 worker processes, and prints entries/s for each (wall clock, and per CPU-second,
which depends less on other load on the machine), the ratio to hashlib's raw rate for one
SHA-256 of an entry line measured the same way (each entry needs two such hashes plus a Merkle
node), and each verifier's peak RSS for N and 4*N entries (bounded memory: about equal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from securetrain.audit.merkle import CompactRange  # noqa: E402
from securetrain.audit.note import sign_checkpoint, verifier_key  # noqa: E402

ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode  # = JCS for ASCII


def build_export(out: Path, n: int, every: int = 1000) -> Path:
    """A valid export written directly (no database): the same bytes AuditLog.export writes."""
    out.mkdir(parents=True)
    key = Ed25519PrivateKey.generate()
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    origin = f"securetrain.local/audit/{hashlib.sha256(pem).hexdigest()[:16]}"
    tree, prev, notes = CompactRange(), "0" * 64, []
    digest = hashlib.sha256()
    with open(out / "entries.jsonl", "wb") as handle:
        for seq in range(n):
            obj = {"v": 1, "seq": seq, "ts": f"2026-12-04T00:{seq // 60 % 60:02d}:{seq % 60:02d}.{seq % 999999:06d}Z",
                   "actor": "svc-train", "hostname": "gpu-node-01", "mac": "aa:bb:cc:dd:ee:ff", "action": "dicom.read",
                   "resource": f"dicom:1.2.840.113619.2.55.3.604688119.969.{seq}", "outcome": "success",
                   "details": {"key_id": "kms:key-1", "rows": 512, "sha256": hashlib.sha256(seq.to_bytes(8, "big")).hexdigest(),
                               "worker": seq % 2},
                   "prev_hash": prev}
            raw = ENCODE(obj).encode()
            handle.write(raw + b"\n")
            digest.update(raw + b"\n")
            prev = hashlib.sha256(raw).hexdigest()
            tree.append(hashlib.sha256(b"\x00" + raw).digest())
            if tree.size % every == 0 or tree.size == n:
                notes.append(sign_checkpoint(origin, tree.size, tree.root(), origin, key).note)
    files = {"checkpoints.note": "".join(notes).encode(), "checkpoint.note": notes[-1].encode(), "public_key.pem": pem,
             "verifier_key.txt": (verifier_key(origin, key.public_key()) + "\n").encode()}
    hashes = {"entries.jsonl": digest.hexdigest()}
    for name, data in files.items():
        (out / name).write_bytes(data)
        hashes[name] = hashlib.sha256(data).hexdigest()
    manifest = {"format": "securetrain-audit-export", "version": 1, "origin": origin, "entries": n, "tree_size": n,
                "root_hash": tree.root().hex(), "files": hashes}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return out


CHILD = r"""
import resource, sys, time
mode, export, workers = sys.argv[1], sys.argv[2], int(sys.argv[4])
pem = export + "/public_key.pem"
if mode == "library":
    sys.path.insert(0, sys.argv[3])
    from securetrain.audit.export import verify_export
    from securetrain.audit.keys import load_public_key_pem
    key = load_public_key_pem(open(pem, "rb").read())
    t0, c0 = time.perf_counter(), time.process_time()  # imports are not part of the measurement
    report = verify_export(export, public_key=key, workers=workers)
    ok = report.ok and report.trusted
else:
    import runpy
    import argparse, base64, binascii, hashlib, html, json, json.encoder, json.scanner, re  # noqa: F401
    from cryptography.hazmat.primitives import serialization  # noqa: F401
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey  # noqa: F401
    sys.argv = ["verify_audit.py", export, "--public-key", pem, "--workers", str(workers)]
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        runpy.run_path(mode, run_name="__main__")
    except SystemExit as exc:
        ok = exc.code == 0
dt = time.perf_counter() - t0
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = time.process_time() - c0 + kids.ru_utime + kids.ru_stime  # worker processes included
print(ok, dt, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def run_child(mode: str, export: Path, workers: int) -> tuple[bool, float, float, int]:
    args = [sys.executable, "-c", CHILD, mode, str(export), str(ROOT), str(workers)]
    if mode != "library":
        args.insert(1, "-I")  # the standalone verifier runs isolated, as auditors run it
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        ok, dt, cpu, rss = last.split()
    except ValueError:
        raise SystemExit(f"child failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}") from None
    return ok == "True", float(dt), float(cpu), int(rss)


def hashlib_rate(line: bytes, n: int) -> tuple[float, float]:
    """Raw SHA-256 of one entry line: (per wall second, per CPU second)."""
    sha256 = hashlib.sha256
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        sha256(line).digest()
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 entries (and 80,000 for the memory check)")
    parser.add_argument("--entries", type=int, default=None)
    args = parser.parse_args()
    n = args.entries or (20_000 if args.quick else 100_000)
    standalone = str(ROOT / "audit" / "verify_audit.py")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        small = build_export(Path(tmp) / "small", n)
        print(f"built a {n}-entry export in {time.perf_counter() - t0:.1f} s "
              f"({os.path.getsize(small / 'entries.jsonl') / n:.0f} bytes/entry)")
        line = (small / "entries.jsonl").open("rb").readline().rstrip(b"\n")
        rates = [hashlib_rate(line, 200_000) for _ in range(3)]
        base, base_cpu = max(r[0] for r in rates), max(r[1] for r in rates)
        print(f"hashlib sha256 of one entry line: {base:,.0f} hashes/s wall, {base_cpu:,.0f} per CPU-second (baseline)")
        print("(per CPU-second rates depend less than wall rates on other load on the machine; "
              f"load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")
        results = {}
        for name, mode in (("securetrain audit verify", "library"), ("audit/verify_audit.py", standalone)):
            for workers in (1, 2):
                runs = [run_child(mode, small, workers) for _ in range(3)]
                ok, dt, cpu, rss = min(runs, key=lambda r: r[1])
                best_cpu = min(r[2] for r in runs)
                assert ok, f"{name} did not verify the benchmark export"
                if workers == 1:
                    results[name] = rss  # compared with the 1-worker run on 4*N below
                print(f"{name:26s} workers={workers}: {n / dt:>9,.0f} entries/s wall = {n / dt / base:.3f} x hashlib; "
                      f"{n / best_cpu:>9,.0f} entries per CPU-second = {n / best_cpu / base_cpu:.3f} x hashlib "
                      f"(peak RSS {rss / 1024:.0f} MiB)")
        big_n = 4 * n
        big = build_export(Path(tmp) / "big", big_n)
        for name, mode in (("securetrain audit verify", "library"), ("audit/verify_audit.py", standalone)):
            ok, dt, cpu, rss = run_child(mode, big, 1)
            assert ok
            print(f"{name:26s} {big_n} entries: {big_n / dt:,.0f} entries/s wall, peak RSS {rss / 1024:.0f} MiB "
                  f"(vs {results[name] / 1024:.0f} MiB for {n}: x{rss / results[name]:.2f})")


if __name__ == "__main__":
    main()

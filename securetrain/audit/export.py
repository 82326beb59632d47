"""Self-contained export an auditor verifies offline with ``audit/verify_audit.py``.

Files: ``entries.jsonl`` (one line per entry: exactly the hashed bytes), ``checkpoints.note`` (all
signed checkpoints, concatenated, oldest first), ``checkpoint.note`` (the latest), ``public_key.pem``,
``verifier_key.txt``, and ``manifest.json`` with the SHA-256 of every other file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from securetrain.io.atomic import atomic_write_bytes, atomic_writer

if TYPE_CHECKING:
    from securetrain.audit.log import AuditLog

EXPORT_FORMAT = "securetrain-audit-export"
EXPORT_VERSION = 1


def export_log(log: AuditLog, outdir: str | os.PathLike[str], *, checkpoint: bool = True) -> Path:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint:
        log.checkpoint()
    cps = log.checkpoints()
    latest = cps[-1] if cps else None
    stop = latest.tree_size if latest else None  # export exactly what the latest checkpoint signs
    hashes: dict[str, str] = {}
    digest = hashlib.sha256()
    count = 0
    with atomic_writer(out / "entries.jsonl", mode=0o600) as handle:
        for entry in log.entries(0, stop):
            line = entry.hashed_bytes() + b"\n"
            handle.write(line)
            digest.update(line)
            count += 1
    hashes["entries.jsonl"] = digest.hexdigest()
    files = {
        "checkpoints.note": "".join(c.note for c in cps).encode(),
        "checkpoint.note": (latest.note if latest else "").encode(),
        "public_key.pem": log.public_key_pem(),
        "verifier_key.txt": (log.verifier_key() + "\n").encode(),
    }
    for name, data in files.items():
        atomic_write_bytes(out / name, data, mode=0o644 if name in ("public_key.pem", "verifier_key.txt") else 0o600)
        hashes[name] = hashlib.sha256(data).hexdigest()
    manifest = {
        "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "origin": log.origin, "entries": count,
        "tree_size": latest.tree_size if latest else 0,
        "root_hash": latest.root_hash.hex() if latest else None, "files": hashes,
    }
    atomic_write_bytes(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n", mode=0o600)
    return out

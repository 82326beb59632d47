"""Append events to a hash-chained audit log, sign a checkpoint, export it and verify the export.

    python examples/scripts/audit_append_verify.py WORK_DIR
"""

import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from securetrain.audit import open_audit_log, verify_export

work = Path(sys.argv[1])
signing_key = Ed25519PrivateKey.generate()  # in production: created once with `securetrain audit keygen`
log = open_audit_log(f"sqlite:///{work / 'audit.db'}", signing_key=signing_key, actor="example")
for i in range(3):
    log.record("data.read", f"file-{i}", details={"bytes": 100 * i})
checkpoint = log.checkpoint()  # signed tree head over every entry so far
export = log.export(work / "export")
log.close()

report = verify_export(export, public_key=signing_key.public_key())  # the auditor pins the key
print(f"checkpoint at size {checkpoint.tree_size}; export verified: {report.ok}")
sys.exit(0 if report.ok else 1)

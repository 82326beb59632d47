"""``python -m securetrain_audit_verify``: run the stand-alone verifier."""

from securetrain_audit_verify.verify_audit import main

raise SystemExit(main())

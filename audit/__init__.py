"""The stand-alone audit verifier, installed as the package ``securetrain_audit_verify``.

``verify_audit.py`` imports only the standard library and ``cryptography``; copy it anywhere and run
``python verify_audit.py --help``, or, from an installed wheel, ``python -m securetrain_audit_verify``
or ``securetrain-audit-verify``.
"""

"""Model release: DP-SGD training (Opacus), signed in-toto provenance, and the k-of-n release gate.

Names are imported lazily so the CLI stays light; ``privacy`` needs the ``privacy`` extra (opacus).
"""

from __future__ import annotations

from securetrain._lazy import lazy_exports

_EXPORTS = {
    "DPTrainer": "privacy",
    "trainer_class": "privacy",
    "PrivacyError": "errors",
    "PrivacyModelError": "errors",
    "ProvenanceError": "errors",
    "ReleaseError": "errors",
    "ReleasePolicyError": "errors",
    "ReleaseRefusedError": "errors",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)

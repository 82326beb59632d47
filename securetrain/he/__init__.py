"""Homomorphic evaluation (CKKS via TenSEAL) of linear heads, logistic models and small MLPs.

Importing this package is cheap and works without TenSEAL or torch; names are resolved lazily.
TenSEAL-backed operations raise :class:`HEUnavailableError` when the ``[he]`` extra is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from securetrain.he.errors import (
    HEError,
    HEFormatError,
    HEKeyError,
    HEKeySourceError,
    HEModelError,
    HEParameterError,
    HEUnavailableError,
    HEUnsupportedLayerError,
)

_LAZY = {
    "HEParams": "securetrain.he.params",
    "choose_params": "securetrain.he.params",
    "SECURITY_MAX_COEFF_BITS": "securetrain.he.params",
    "HEPlan": "securetrain.he.plan",
    "compile_plan": "securetrain.he.plan",
    "fit_activation": "securetrain.he.approximations",
    "PolyApprox": "securetrain.he.approximations",
    "PolyActivation": "securetrain.he.modules",
    "Square": "securetrain.he.modules",
    "DataOwner": "securetrain.he.roles",
    "Evaluator": "securetrain.he.roles",
    "check_plan_fits": "securetrain.he.roles",
    "bundle_info": "securetrain.he.roles",
    "seal_secret_context": "securetrain.he.secret_store",
    "open_secret_context": "securetrain.he.secret_store",
    "SECRET_CONTEXT_AD": "securetrain.he.secret_store",
    "save_sequential": "securetrain.he.model_io",
    "load_sequential": "securetrain.he.model_io",
    "evaluate_encrypted": "securetrain.he.evaluate",
    "HEEvaluationReport": "securetrain.he.evaluate",
    "split_for_he": "securetrain.he.split",
    "calibrate": "securetrain.he.calibration",
    "Calibration": "securetrain.he.calibration",
    "trace_layers": "securetrain.he.layers",
}

__all__ = [
    "HEError", "HEFormatError", "HEKeyError", "HEKeySourceError", "HEModelError", "HEParameterError", "HEUnavailableError",
    "HEUnsupportedLayerError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'securetrain.he' has no attribute {name!r}")

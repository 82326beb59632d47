"""Typed errors of the homomorphic-evaluation capability.

They derive from the shared hierarchy so the CLI prints them as one line and callers can tell
"refused for safety" (parameters, keys) from "bad file" (format/integrity).
"""

from __future__ import annotations

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError


class HEError(SecureTrainError):
    """Base class of every error raised by :mod:`securetrain.he`."""


class HEUnavailableError(HEError):
    """TenSEAL is not installed (it is an optional extra)."""

    def __init__(self, message: str = "homomorphic evaluation needs the optional dependency 'tenseal'") -> None:
        super().__init__(message, hint="pip install 'securetrain[he]'")


class HEParameterError(HEError, ConfigError):
    """Encryption parameters are insecure, malformed, or too small for the model (depth/headroom)."""


class HEModelError(HEError, ConfigError):
    """The model cannot be turned into an HE evaluation plan (unsupported layer, bad shapes)."""


class HEPlanMismatchError(HEModelError):
    """The plan an evaluator runs (its model, approximations or ``--output``) is not the one the
    data owner encrypted the inputs for: their value bound was calibrated on another computation,
    or the data owner would receive other scores than it asked for."""


class HEFormatError(HEError, IntegrityError):
    """A context/ciphertext/model file is malformed, truncated, corrupted, or of the wrong kind."""


class HEKeyError(HEError):
    """Wrong key material for the operation: a secret key where only a public one is allowed,
    no secret key where decryption needs one, or data encrypted under a different context."""


class HEKeySourceError(HEError, ConfigError):
    """No key-encryption key is configured to protect (or open) the data owner's secret context."""


class HEUnsupportedLayerError(HEModelError):
    """A layer of the model has no HE evaluation (convolution, pooling, normalisation over
    features, …). ``layer_path`` is its module path in the model, ``layer_type`` its class."""

    def __init__(self, layer_path: str, layer_type: str, why: str = "") -> None:
        self.layer_path = layer_path
        self.layer_type = layer_type
        reason = f": {why}" if why else ""
        super().__init__(
            f"layer '{layer_path}' ({layer_type}) cannot be evaluated under homomorphic encryption{reason}",
            hint="HE evaluates Linear, BatchNorm1d (eval), Flatten/Identity/Dropout, PolyActivation/Square and "
                 "polynomial-approximated ReLU/Sigmoid/Tanh/SiLU/GELU/Softplus; run the layers before the head on the "
                 "data owner's side: trunk, tail = securetrain.he.split_for_he(model)",
        )

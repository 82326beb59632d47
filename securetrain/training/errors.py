"""Typed errors for the training engine and its checkpoint stores."""

from __future__ import annotations

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError


class TrainingError(SecureTrainError):
    """Training could not start or continue (bad batch, non-finite loss, ...)."""


class CheckpointNotFoundError(TrainingError):
    """A checkpoint was requested but the store holds none (or not the one asked for)."""


class CheckpointCorruptError(TrainingError, IntegrityError):
    """A checkpoint file is truncated, malformed, or does not match its recorded digest."""


class ResumeMismatchError(TrainingError, ConfigError):
    """The checkpoint was written by a run whose settings make an exact resume impossible."""


class UncheckpointableStateError(TrainingError):
    """A value in the optimizer/scaler/callback state has no checkpoint form (tensors, lists, tuples,
    dicts, int, float, bool, str and None have one); the message names where it is."""


class ModelArchitectureError(TrainingError, ConfigError):
    """A checkpoint's weights belong to another architecture than the one rebuilt to load them
    (e.g. trained as DP-SGD's fixed copy, BatchNorm -> GroupNorm, and the model no longer fixes the
    same way); the message names the layers."""


class ConstantNormError(TrainingError, ConfigError):
    """A normalisation layer (GroupNorm, LayerNorm, InstanceNorm) normalises one value per sample and
    group, so it outputs its bias whatever its input and the model learns nothing before it; the
    message names the layers (:mod:`securetrain.training.constant_norm`)."""

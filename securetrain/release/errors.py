"""Typed errors for differential privacy, signed provenance and the release gate."""

from __future__ import annotations

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError


class ReleaseError(SecureTrainError):
    """Base for the release capability (DP training, provenance, release gate)."""


class PrivacyError(ReleaseError):
    """DP-SGD cannot run as configured (unsupported data source, precision, distributed setup)."""


class PrivacyModelError(PrivacyError):
    """The model has layers DP-SGD cannot train and that Opacus cannot safely replace."""


class ProvenanceError(ReleaseError, IntegrityError):
    """A provenance statement is malformed, unsigned, wrongly signed, or does not match the evidence."""


class ReleasePolicyError(ReleaseError, ConfigError):
    """policies/release.yaml is missing or invalid."""


class ReleaseRefusedError(ReleaseError):
    """The release gate refused: ``failures`` names every condition that did not hold."""

    def __init__(self, failures: list[str]) -> None:
        self.failures = list(failures)
        super().__init__(
            "release refused: " + "; ".join(self.failures),
            hint="fix each failed condition (see docs/release.md); nothing was written",
        )

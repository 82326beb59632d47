"""Typed errors of DICOM de-identification. Messages never carry attribute values (PHI)."""

from __future__ import annotations

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError


class DeidError(SecureTrainError):
    """A DICOM object could not be de-identified safely; nothing was written for it."""


class BurnedInAnnotationError(DeidError):
    """The pixels may carry burned-in text and the policy does not allow (or cannot) mask it."""


class MissingPatientIdentityError(DeidError):
    """Neither PatientID nor PatientName (nor, with ``missing_patient_identity: study``, a Study
    Instance UID) gives the object a patient identity to pseudonymise, and the policy requires one."""


class UnreadableDicomError(DeidError):
    """The input is not DICOM, is truncated, or its pixels cannot be decoded."""


class DeidKeyError(DeidError, ConfigError):
    """The de-identification secret or mapping key is missing or too weak."""


class MappingIntegrityError(DeidError, IntegrityError):
    """An encrypted pseudonym mapping failed authentication (wrong key, tampered or truncated)."""


class OcrUnavailable(DeidError, ConfigError):
    """``burned_in: clean`` needs Tesseract (Debian ``tesseract-ocr``) and ``pytesseract``."""

"""Typed errors of DICOM de-identification. Messages never carry attribute values (PHI)."""

from __future__ import annotations

from securetrain.errors import ConfigError, IntegrityError, SecureTrainError

#: Exit status of ``securetrain deid`` and ``securetrain run`` when input files were quarantined
#: (could not be processed: not DICOM, truncated, corrupt) and that was not accepted
#: (``--allow-quarantine``, ``data.allow_quarantine``). Files the policy rejects on purpose
#: (burned-in text, no patient identity) are reported but never fail a run. 65 is ``EX_DATAERR`` of
#: sysexits.h ("the input data was incorrect").
REFUSED_FILES_EXIT_CODE = 65


class DeidError(SecureTrainError):
    """A DICOM object could not be de-identified safely; nothing was written for it."""


class BurnedInAnnotationError(DeidError):
    """The pixels may carry burned-in text and the policy does not allow (or cannot) mask it."""


class MissingPatientIdentityError(DeidError):
    """Neither PatientID nor PatientName (nor, with ``missing_patient_identity: study``, a Study
    Instance UID) gives the object a patient identity to pseudonymise, and the policy requires one."""


class DicomDirectoryError(DeidError):
    """The input is a DICOMDIR (Media Storage Directory, PS3.10): the index of a CD or folder, not an
    object to de-identify. It names the input files and repeats patient names, IDs and dates in its
    directory records, and its references would not match the renamed outputs, so it is never copied
    (a folder run reports it as *rejected*); build a new DICOMDIR for the output if one is needed."""


class EncapsulatedDocumentError(DeidError):
    """The object carries an encapsulated document ((0042,0011): PDF, CDA, STL/OBJ/MTL models) and
    the policy refuses it (``encapsulated_documents: reject``, the default). The document's own
    text -- a report or letter naming the patient -- is beyond metadata de-identification, so the
    object is not written (a folder run reports it as *rejected*)."""


class UnreadableDicomError(DeidError):
    """The input is not DICOM, is truncated, or its pixels cannot be decoded."""


class DeidKeyError(DeidError, ConfigError):
    """The de-identification secret or mapping key is missing or too weak."""


class MappingIntegrityError(DeidError, IntegrityError):
    """An encrypted pseudonym mapping failed authentication (wrong key, tampered or truncated)."""


class OcrUnavailable(DeidError, ConfigError):
    """``burned_in: clean`` needs Tesseract (Debian ``tesseract-ocr``) and ``pytesseract``."""


class RefusedFilesError(DeidError):
    """Input files were quarantined (could not be processed) and partial output was not accepted
    (``data.allow_quarantine``). Rejected files alone never raise it. The CLI exits with
    :data:`REFUSED_FILES_EXIT_CODE` (``exit_code``)."""

    exit_code = REFUSED_FILES_EXIT_CODE

    def __init__(self, message: str, *, hint: str | None = None, report: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.report = report  # where the refusal report is (no PHI: indexes, digests, reasons)


class ColorModeError(DeidError, ConfigError):
    """``color_mode="rgb"`` (``data.color_mode: rgb``) met a one-channel (grey) file: a model built
    for three colour channels cannot take it. ``path`` names the file relative to the data set's
    root (de-identified pipeline files are sequence numbers); never an attribute value."""

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class PaletteColorError(DeidError):
    """A PALETTE COLOR image whose palette cannot be read exactly (entries other than 8 or 16 bits,
    data that does not match its descriptor, red/green/blue descriptors that differ, a segmented
    palette with 8-bit entries, an unknown byte order). Refused rather than guessed: a wrong palette
    gives plausible-looking but wrong colours. Messages name the defect, never a value."""

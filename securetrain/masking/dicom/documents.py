"""Encapsulated documents (PS3.3 C.24.2: PDF, CDA, STL/OBJ/MTL models in (0042,0011)).

The document is opaque bytes to de-identification: a PDF report or CDA letter names the patient
in its own text, and an STL header or OBJ comment can too. Nothing here parses documents; the
policy field ``encapsulated_documents`` decides whether such an object is refused (``reject``,
the default), written without its document (``remove``) or copied with it (``keep``).
"""

from __future__ import annotations

from pydicom.dataset import Dataset
from pydicom.uid import UID

from securetrain.masking.dicom.errors import EncapsulatedDocumentError

TAG_ENCAPSULATED_DOCUMENT = 0x00420011
TAG_ENCAPSULATED_DOCUMENT_LENGTH = 0x00420015
# Encapsulated PDF/CDA/STL/OBJ/MTL Storage (1.2.840.10008.5.1.4.1.1.104.1 ... .5) and any later one.
ENCAPSULATED_DOCUMENT_CLASS_ROOT = "1.2.840.10008.5.1.4.1.1.104."

_HINT = (
    "policy encapsulated_documents: remove writes the object without its document (length 0); "
    "keep copies the document unchanged -- only for documents known to carry no personal data"
)


def document_kind(sop_class: str) -> str:
    """The SOP class's name (``Encapsulated PDF Storage``), or its UID when pydicom does not know it."""
    name = UID(sop_class).name if sop_class else ""
    return name if name and name != sop_class else (sop_class or "an object without SOP class")


def is_encapsulated_document(ds: Dataset) -> bool:
    """An encapsulated-document object: it has (0042,0011) at the top level or an encapsulated
    document SOP class (with or without the element: fail closed on a broken one)."""
    return TAG_ENCAPSULATED_DOCUMENT in ds._dict or sop_class_of(ds).startswith(ENCAPSULATED_DOCUMENT_CLASS_ROOT)


def sop_class_of(ds: Dataset) -> str:
    return str(ds.get("SOPClassUID", "") or "").strip(" \x00")


def refuse_document(sop_class: str, label: str, path: str = "") -> EncapsulatedDocumentError:
    """The rejection of an object of ``sop_class`` with an encapsulated document (at ``path`` inside
    it, if nested). Names the SOP class and tags, never the document, its title or MIME type."""
    where = f" at {path}" if path else ""
    return EncapsulatedDocumentError(
        f"{label}: {document_kind(sop_class)} object with an encapsulated document{where}: its text can "
        "identify the patient and de-identification cannot clean it (policy encapsulated_documents: reject)",
        hint=_HINT,
    )

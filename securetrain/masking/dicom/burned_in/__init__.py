"""Burned-in text in pixel data: policy ``burned_in: reject | clean | allow-flagged``.

``clean`` finds text with OCR (Tesseract) on preprocessed frames, masks it with a margin in every
frame together with the policy's CTP-style ``known_regions``, verifies with another OCR pass and
re-encodes the pixel data; see docs/dicom-deid.md, "Burned-in text (pixel PHI)".
"""

from __future__ import annotations

from securetrain._lazy import lazy_exports

_EXPORTS = {
    "BurnedInCleaner": "cleaner",
    "BurnedInCounts": "cleaner",
    "BurnedInOutcome": "cleaner",
    "OcrUnavailable": "cleaner",
    "Region": "regions",
    "TesseractEngine": "ocr",
    "OcrEngine": "ocr",
    "Word": "ocr",
    "find_text": "detect",
    "TextRule": "detect",
    "Text": "synthetic",
    "make_image": "synthetic",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)

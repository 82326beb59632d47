"""OCR through Tesseract (the ``tesseract-ocr`` Debian package, driven by ``pytesseract``).

Each Tesseract call is a process start plus model load (~50-100 ms), so many small crops are
packed into one tall "sheet" per call and the words are mapped back to the crop they fall in.
Recognised text never leaves this module's return values: callers keep boxes, not strings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np

_SHEET_GAP = 24
_SHEET_MAX_HEIGHT = 8000  # Tesseract copes with tall pages, but one huge page is slow to lay out


@dataclass(frozen=True)
class Word:
    """One OCR word in the coordinates of the image it was read from."""

    text: str
    confidence: float
    left: int
    top: int
    width: int
    height: int

    def alnum_count(self) -> int:
        return sum(ch.isalnum() for ch in self.text)


class OcrEngine(Protocol):
    """Reads words from 8-bit grayscale images; one list of words per image."""

    name: str

    def read(self, images: list[np.ndarray]) -> list[list[Word]]: ...


class OcrUnavailableError(RuntimeError):
    """Tesseract or pytesseract is missing (turned into a typed policy error by the caller)."""


@lru_cache(maxsize=1)
def tesseract_version() -> str:
    """The Tesseract version string; raises :class:`OcrUnavailableError` when it cannot run."""
    try:
        import pytesseract
    except ImportError:
        raise OcrUnavailableError("the pytesseract package is not installed (pip install 'securetrain[ocr]')") from None
    try:
        return str(pytesseract.get_tesseract_version()).split()[0]
    except Exception as exc:  # TesseractNotFoundError, OSError, ...
        raise OcrUnavailableError(
            f"the tesseract program cannot run ({type(exc).__name__}); install the Debian package tesseract-ocr"
        ) from None


class TesseractEngine:
    """Tesseract with sparse-text page segmentation (``--psm 11``): burned-in text is scattered
    words and short lines, not paragraphs."""

    def __init__(self, language: str = "eng", *, psm: int = 11) -> None:
        self.version = tesseract_version()
        self.language = language
        self.psm = psm
        self.name = f"tesseract {self.version}"

    def read(self, images: list[np.ndarray]) -> list[list[Word]]:
        results: list[list[Word]] = [[] for _ in images]
        for batch in _batches(images):
            self._read_sheet(images, batch, results)
        return results

    def _read_sheet(self, images: list[np.ndarray], batch: list[int], results: list[list[Word]]) -> None:
        import pytesseract
        from PIL import Image

        width = max(images[i].shape[1] for i in batch) + 2 * _SHEET_GAP
        height = sum(images[i].shape[0] + _SHEET_GAP for i in batch) + _SHEET_GAP
        sheet = np.full((height, width), 255, dtype=np.uint8)
        spans: list[tuple[int, int, int]] = []  # (top, bottom, image index)
        y = _SHEET_GAP
        for i in batch:
            h, w = images[i].shape
            sheet[y : y + h, _SHEET_GAP : _SHEET_GAP + w] = images[i]
            spans.append((y, y + h, i))
            y += h + _SHEET_GAP
        # Tesseract's OpenMP threads fight over the same cores as our worker processes, so its
        # process runs with OMP_THREAD_LIMIT=1. Only its process: set in our own environment, the
        # limit would reach torch (and every child) and hang a later backward pass.
        pytesseract.pytesseract.environ = {**os.environ, "OMP_THREAD_LIMIT": "1"}
        data = pytesseract.image_to_data(
            Image.fromarray(sheet), lang=self.language, config=f"--psm {self.psm}", output_type=pytesseract.Output.DICT
        )
        for text, conf, left, top, w, h in zip(
            data["text"], data["conf"], data["left"], data["top"], data["width"], data["height"], strict=True
        ):
            text = str(text).strip()
            if not text:
                continue
            cy = int(top) + int(h) / 2
            for s_top, s_bottom, idx in spans:
                if s_top - _SHEET_GAP / 2 <= cy < s_bottom + _SHEET_GAP / 2:
                    results[idx].append(
                        Word(text, float(conf), int(left) - _SHEET_GAP, int(top) - s_top, int(w), int(h))
                    )
                    break


def _batches(images: list[np.ndarray]) -> list[list[int]]:
    """Indexes of ``images`` grouped into sheets of bounded height; a full frame gets its own."""
    out: list[list[int]] = []
    current: list[int] = []
    height = 0
    for i, img in enumerate(images):
        h = img.shape[0] + _SHEET_GAP
        if current and height + h > _SHEET_MAX_HEIGHT:
            out.append(current)
            current, height = [], 0
        current.append(i)
        height += h
    if current:
        out.append(current)
    return out

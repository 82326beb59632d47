"""Find burned-in text in 8-bit frames: candidate lines confirmed by OCR, plus whole-frame OCR."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from securetrain.masking.dicom.burned_in.ocr import OcrEngine, Word
from securetrain.masking.dicom.burned_in.preprocess import full_frame_views, text_candidates
from securetrain.masking.dicom.burned_in.regions import Region


@dataclass(frozen=True)
class TextRule:
    """When an OCR word counts as text: enough letters/digits, read with enough confidence."""

    min_confidence: float = 40.0
    min_alnum: int = 2

    def accepts(self, word: Word) -> bool:
        return word.alnum_count() >= self.min_alnum and word.confidence >= self.min_confidence


def find_text(
    frames: list[np.ndarray],
    engine: OcrEngine,
    rule: TextRule,
    *,
    full_frame: bool = True,
    min_contrast: int = 40,
) -> list[Region]:
    """Boxes (frame coordinates, union over ``frames``) of everything OCR reads as text.

    A candidate line is reported as a whole when any word read from its crop passes ``rule``;
    whole-frame words are reported by their own (rescaled) boxes."""
    candidates = [c for i, f in enumerate(frames) for c in text_candidates(f, i, min_contrast=min_contrast)]
    images: list[np.ndarray] = [c.crop for c in candidates]
    views: list[float] = []
    if full_frame:
        for f in frames:
            for view, scale in full_frame_views(f):
                images.append(view)
                views.append(scale)
    if not images:
        return []
    words = engine.read(images)
    found: list[Region] = []
    for cand, cand_words in zip(candidates, words[: len(candidates)], strict=True):
        if any(rule.accepts(w) for w in cand_words):
            found.append(Region(cand.x0, cand.y0, cand.x1, cand.y1, "ocr"))
    for scale, view_words in zip(views, words[len(candidates) :], strict=True):
        for w in view_words:
            if rule.accepts(w):
                found.append(
                    Region(
                        int(w.left / scale), int(w.top / scale),
                        int(np.ceil((w.left + w.width) / scale)), int(np.ceil((w.top + w.height) / scale)),
                        "ocr",
                    )
                )
    return found

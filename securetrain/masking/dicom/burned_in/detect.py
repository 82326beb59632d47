"""Find burned-in text in 8-bit frames: candidate lines confirmed by OCR, plus whole-frame OCR."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from securetrain.masking.dicom.burned_in.ocr import OcrEngine, Word
from securetrain.masking.dicom.burned_in.preprocess import CROP_FRAME, full_frame_views, line_crop, text_candidates
from securetrain.masking.dicom.burned_in.regions import Region


@dataclass(frozen=True)
class TextRule:
    """When an OCR word counts as text.

    * fewer than ``min_alnum`` letters/digits: never (stray marks, speckle read as "a", "*");
    * short words (up to 3 letters/digits) need ``short_confidence``: noise is often read as a
      confident-looking 3-letter word, real short words sit on a line with longer ones;
    * longer words need ``min_confidence``;
    * words of ``long_word`` or more letters/digits (and little else) count at any confidence:
      Tesseract's score leans on its dictionary, so names and IDs (``SMITH^ANNA``) are often
      read right with a low score.
    """

    min_confidence: float = 40.0
    min_alnum: int = 3
    short_confidence: float = 80.0
    long_word: int = 5
    full_frame_confidence: float = 60.0

    def accepts(self, word: Word, *, typeset: bool = False) -> bool:
        """``typeset``: the glyphs were seen to share a baseline and height, which vouches for
        short words as much as a high OCR confidence does."""
        alnum = word.alnum_count()
        if alnum < self.min_alnum:
            return False
        if alnum >= self.long_word and alnum >= 0.75 * len(word.text):
            return True
        if alnum <= 3 and not typeset:
            return word.confidence >= max(self.short_confidence, self.min_confidence)
        return word.confidence >= self.min_confidence

    def accepts_line(self, words: list[Word], *, typeset: bool = False) -> bool:
        """A line is text when one word is, or when its confidently read words of two or more
        letters/digits together carry ``long_word`` of them, one word having three or more
        (``ID 551`` read as two short words; not ``va os ar`` read from texture)."""
        if any(self.accepts(w, typeset=typeset) for w in words):
            return True
        sure = [w.alnum_count() for w in words if w.confidence >= self.min_confidence and w.alnum_count() >= 2]
        return sum(sure) >= self.long_word and max(sure, default=0) >= 3

    def accepts_full_frame(self, word: Word) -> bool:
        """Whole-frame OCR sees all the texture too, so only long, confidently read runs of
        letters/digits count there (no false finds on speckle or noise in our tests, while
        catching text the line step missed)."""
        alnum = word.alnum_count()
        return alnum >= self.long_word and alnum >= 0.75 * len(word.text) and word.confidence >= self.full_frame_confidence

    def maskable(self, word: Word) -> bool:
        """Words of an accepted line that get their own mask."""
        return self.accepts(word) or (word.alnum_count() >= 1 and word.confidence >= self.min_confidence)


def find_text(
    frames: list[np.ndarray],
    engine: OcrEngine,
    rule: TextRule,
    *,
    full_frame: bool = True,
    min_contrast: int = 40,
) -> list[Region]:
    """Boxes (frame coordinates, union over ``frames``) of everything OCR reads as text.

    First the line candidates (cheap: small crops); only when they find nothing, and
    ``full_frame`` is set, whole frames (expensive), whose finds are masked and searched again
    by the caller like any other. So a whole-frame read happens about once per file, as the
    check that closes the loop."""
    found = find_line_text(frames, engine, rule, min_contrast=min_contrast)
    if not found and full_frame:
        found = find_frame_text(frames, engine, rule)
    return found


def find_line_text(frames: list[np.ndarray], engine: OcrEngine, rule: TextRule, *, min_contrast: int = 40) -> list[Region]:
    """Candidate lines confirmed by OCR (each as a whole box), plus their words re-read in wider
    strips."""
    candidates = [c for i, f in enumerate(frames) for c in text_candidates(f, i, min_contrast=min_contrast)]
    if not candidates:
        return []
    words = engine.read([c.crop for c in candidates])
    confirmed = [c for c, cw in zip(candidates, words, strict=True) if rule.accepts_line(cw, typeset=c.regular)]
    found = [Region(c.x0, c.y0, c.x1, c.y1, "ocr") for c in confirmed]
    return found + _extend_lines(frames, confirmed, engine, rule)


def find_frame_text(frames: list[np.ndarray], engine: OcrEngine, rule: TextRule) -> list[Region]:
    """Words read from whole frames and their inverses (upscaled), by the strict whole-frame rule."""
    images: list[np.ndarray] = []
    scales: list[float] = []
    for f in frames:
        for view, scale in full_frame_views(f):
            images.append(view)
            scales.append(scale)
    found = []
    for scale, view_words in zip(scales, engine.read(images), strict=True):
        for w in view_words:
            if rule.accepts_full_frame(w):
                found.append(
                    Region(
                        int(w.left / scale), int(w.top / scale),
                        int(np.ceil((w.left + w.width) / scale)), int(np.ceil((w.top + w.height) / scale)),
                        "ocr",
                    )
                )
    return found


def _extend_lines(frames: list[np.ndarray], confirmed: list, engine: OcrEngine, rule: TextRule) -> list[Region]:
    """Re-read each confirmed line in a wider strip (several line heights left and right): glyphs
    that the candidate step lost to noise or low contrast are read as part of the same words,
    and every accepted word is masked by its own box."""
    if not confirmed:
        return []
    crops, maps = [], []
    for c in confirmed:
        frame = frames[c.frame]
        h = c.y1 - c.y0
        box = (max(0, c.x0 - 6 * h), c.y0, min(frame.shape[1], c.x1 + 6 * h), c.y1)
        crop, scale, ox, oy = line_crop(frame, box, c.polarity)
        crops.append(crop)
        maps.append((scale, ox, oy, frame.shape))
    out = []
    for (scale, ox, oy, shape), cw in zip(maps, engine.read(crops), strict=True):
        if not rule.accepts_line(cw):
            continue
        for w in cw:
            if not rule.maskable(w):
                continue
            x0 = ox + (w.left - CROP_FRAME) / scale
            y0 = oy + (w.top - CROP_FRAME) / scale
            x1 = ox + (w.left + w.width - CROP_FRAME) / scale
            y1 = oy + (w.top + w.height - CROP_FRAME) / scale
            r = Region(int(x0), int(y0), int(np.ceil(x1)), int(np.ceil(y1)), "ocr").clipped(shape[0], shape[1])
            if r is not None:
                out.append(r)
    return out

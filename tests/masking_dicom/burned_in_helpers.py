"""Test helpers for the burned-in text tests; the renderer lives in the package (also used by the
benchmark): securetrain.masking.dicom.burned_in.synthetic."""

from __future__ import annotations

import numpy as np
from pydicom.dataset import Dataset

from securetrain.masking.dicom.burned_in.ocr import Word
from securetrain.masking.dicom.burned_in.synthetic import Text, background, make_image, render, roundtrip
from securetrain.masking.dicom.policy import DicomPolicy, load_policy

__all__ = ["Text", "background", "frames_of", "make_image", "normalise", "ocr_text", "region_map", "render", "roundtrip"]


def region_map(regions: list, rows: int, cols: int) -> np.ndarray:
    cover = np.zeros((rows, cols), dtype=bool)
    for r in regions:
        cover[r.y0 : r.y1, r.x0 : r.x1] = True
    return cover


def frames_of(ds: Dataset) -> np.ndarray:
    arr = ds.pixel_array
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    return arr.reshape((frames, int(ds.Rows), int(ds.Columns), samples))


def ocr_text(ds: Dataset) -> str:
    """Everything plain Tesseract reads in any frame of ``ds`` (both polarities, upscaled x3),
    normalised to upper-case letters and digits: an independent check of the output."""
    import pytesseract
    from PIL import Image

    out = []
    for frame in frames_of(ds):
        gray = frame.astype(np.float32).max(axis=-1)
        lo, hi = float(gray.min()), float(gray.max())
        img8 = np.zeros(gray.shape, np.uint8) if hi <= lo else ((gray - lo) * 255 / (hi - lo)).astype(np.uint8)
        big = Image.fromarray(img8).resize((img8.shape[1] * 3, img8.shape[0] * 3), Image.Resampling.BICUBIC)
        for im in (big, Image.fromarray(255 - np.asarray(big))):
            out.append(pytesseract.image_to_string(im, config="--psm 11"))
    return normalise(" ".join(out))


def normalise(text: str) -> str:
    return "".join(ch for ch in text.upper() if ch.isalnum())


#: A minimal policy document; ``policy(**changes)`` loads it with the given fields changed.
BASE_POLICY = {"policy_version": 1, "name": "t", "profile": "basic", "options": []}


def policy(**changes: object) -> DicomPolicy:
    return load_policy(data={**BASE_POLICY, **changes})


class ScriptedEngine:
    """An OCR engine that reads the same words from every image (or none): drives the cleaner's
    decisions without Tesseract. ``calls`` counts the reads."""

    name = "scripted"

    def __init__(self, words: list[Word] | None = None) -> None:
        self.words = words or []
        self.calls = 0

    def read(self, images: list[np.ndarray]) -> list[list[Word]]:
        self.calls += 1
        return [list(self.words) for _ in images]

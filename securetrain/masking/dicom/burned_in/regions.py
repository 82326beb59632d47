"""Rectangles that get masked, and why. Coordinates only: never any recognised text (PHI)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Region:
    """Pixel rectangle ``[x0, x1) x [y0, y1)`` in image coordinates, with its provenance.

    ``source`` is ``ocr`` (text found by OCR), ``known`` (a policy ``known_regions`` entry, masked
    without OCR) or ``pixel_mask`` (a Clean Pixel Data ``pixel_masks`` entry)."""

    x0: int
    y0: int
    x1: int
    y1: int
    source: str = "ocr"
    label: str = ""

    @property
    def area(self) -> int:
        return max(0, self.x1 - self.x0) * max(0, self.y1 - self.y0)

    def grown(self, margin: int, rows: int, columns: int) -> Region:
        """This rectangle plus ``margin`` pixels on every side, clipped to the image."""
        return Region(
            max(0, self.x0 - margin), max(0, self.y0 - margin),
            min(columns, self.x1 + margin), min(rows, self.y1 + margin),
            self.source, self.label,
        )

    def clipped(self, rows: int, columns: int) -> Region | None:
        r = Region(max(0, self.x0), max(0, self.y0), min(columns, self.x1), min(rows, self.y1), self.source, self.label)
        return r if r.x1 > r.x0 and r.y1 > r.y0 else None

    def overlaps(self, other: Region) -> bool:
        return self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1

    def to_dict(self) -> dict[str, object]:
        return {"x0": self.x0, "y0": self.y0, "x1": self.x1, "y1": self.y1, "source": self.source, "label": self.label}

    def describe(self) -> str:
        """Short form for (0012,0063) De-identification Method (LO, 64 characters at most)."""
        text = f"masked {self.source} ({self.x0},{self.y0},{self.x1},{self.y1})"
        if self.label:
            text += f" {self.label}"
        return text[:64]


def merge_regions(regions: Iterable[Region], gap: int = 0) -> list[Region]:
    """Union rectangles of the same source that overlap or lie within ``gap`` pixels of each
    other (fewer, larger boxes; the same covered pixels or more). Closing small gaps matters: a
    one-pixel strip of background left between two black boxes is a thin bright line, which
    the next OCR pass would take for a stroke. Repeats until stable."""
    items = sorted(set(regions))
    changed = True
    while changed:
        changed = False
        out: list[Region] = []
        for r in items:
            for i, o in enumerate(out):
                if o.source == r.source and o.grown(gap, 1 << 30, 1 << 30).overlaps(r):
                    out[i] = Region(min(o.x0, r.x0), min(o.y0, r.y0), max(o.x1, r.x1), max(o.y1, r.y1), o.source,
                                    o.label if o.label == r.label else "")
                    changed = True
                    break
            else:
                out.append(r)
        items = sorted(out)
    return items


def covered_fraction(regions: Iterable[Region], rows: int, columns: int) -> float:
    """Fraction of the image area inside at least one region (overlaps counted once)."""
    import numpy as np

    cover = np.zeros((rows, columns), dtype=bool)
    for r in regions:
        cover[max(0, r.y0) : min(rows, r.y1), max(0, r.x0) : min(columns, r.x1)] = True
    return float(cover.mean()) if cover.size else 0.0

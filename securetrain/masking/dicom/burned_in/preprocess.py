"""Turn decoded pixel data into what OCR reads well.

Burned-in text is drawn on top of the image as thin strokes of one (often saturated) value, bright
on dark or dark on bright, over backgrounds that may be noisy (ultrasound speckle) or shaded
(gradients, vignetting). Tesseract binarises globally and wants dark glyphs of >= ~20 pixels on a
clean white page, so each frame is:

1. windowed to 8 bits (the stored VOI window when there is one, else its full min..max range);
2. flattened with morphological top-hats, which keep structures thinner than the element
   (strokes) and drop everything wider (backgrounds, gradients, organs), once for bright and
   once for dark text (inverted contrast);
3. binarised and cleaned: connected components that cannot be glyphs (too small, too large) go;
4. grouped into text-line candidates, which are cropped, upscaled so that small text reaches a
   height Tesseract reads reliably, and handed to OCR as black-on-white.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Structuring element of the top-hat: strokes up to ~7 px wide survive (fonts up to ~60 px).
_TOPHAT_SIZE = 15
# A glyph is at least this many pixels and between these heights (in image pixels).
_MIN_GLYPH_AREA = 4
_MIN_GLYPH_HEIGHT = 4
# Noise floor = this x the 98th percentile of the stroke response (see _glyph_mask).
_NOISE_FACTOR = 0.8


@dataclass(frozen=True)
class Candidate:
    """A possible text line: its box in frame coordinates and a black-on-white crop for OCR."""

    frame: int
    x0: int
    y0: int
    x1: int
    y1: int
    crop: np.ndarray  # uint8, text black (0) on white (255), already upscaled
    scale: float
    polarity: str = "bright"
    regular: bool = False  # glyphs share a baseline and a height, like typeset text


def to_gray(frame: np.ndarray) -> np.ndarray:
    """Luminance of a colour frame (rows, cols, 3) or the frame itself, as float32."""
    if frame.ndim == 3:
        if frame.shape[-1] == 1:
            return frame[..., 0].astype(np.float32)
        f = frame.astype(np.float32)
        # Coloured annotation (yellow, green) can sit on a gray image with little luminance
        # contrast; the max channel keeps it bright.
        return np.maximum(0.299 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2], f.max(axis=-1))
    return frame.astype(np.float32)


def window_to_uint8(gray: np.ndarray, window: tuple[float, float] | None = None) -> np.ndarray:
    """Map to 0..255: through ``(center, width)`` when given, else the frame's own min..max."""
    if window is not None and window[1] > 1:
        center, width = window
        lo, hi = center - width / 2.0, center + width / 2.0
    else:
        lo, hi = float(gray.min()), float(gray.max())
    if hi <= lo:
        return np.zeros(gray.shape, dtype=np.uint8)
    out = (gray - lo) * (255.0 / (hi - lo))
    return np.clip(out, 0, 255).astype(np.uint8)


def _tophats(img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from scipy import ndimage as ndi

    # A light blur first: pixel noise shrinks ~3x, one-pixel strokes keep most of their contrast.
    f = ndi.gaussian_filter(img.astype(np.float32), sigma=0.8)
    size = (_TOPHAT_SIZE, _TOPHAT_SIZE)
    bright = f - ndi.grey_opening(f, size=size)
    dark = ndi.grey_closing(f, size=size) - f
    return np.clip(bright, 0, 255).astype(np.uint8), np.clip(dark, 0, 255).astype(np.uint8)


def _glyph_mask(tophat: np.ndarray, min_contrast: int) -> np.ndarray:
    """Strong thin structures that stand out from their neighbourhood.

    The threshold is local: ``min_contrast`` gray levels at least, and well above the mean stroke
    response around the pixel, so that textured areas (speckle) where everything is "thin and
    bright" drop out while text on a quiet or smoothly shaded background stays."""
    from scipy import ndimage as ndi

    th = tophat.astype(np.float32)
    # Noise floor of the whole frame: text covers a few percent of it at most, so the 98th
    # percentile of the stroke response is what noise and texture alone reach.
    floor = max(float(min_contrast), _NOISE_FACTOR * float(np.percentile(th, 98)))
    # Background level around each pixel, with strong strokes clipped so text does not raise it.
    local = ndi.uniform_filter(np.minimum(th, floor), size=31)
    mask = th >= np.maximum(floor, 2.5 * local)
    if not mask.any():
        return mask
    labels, n = ndi.label(mask, structure=np.ones((3, 3), dtype=bool))
    # Burned-in annotation fonts stay well under 80 px; taller blobs are anatomy or colour flow.
    max_h = max(12, min(tophat.shape[0] // 4, 80))
    keep = np.zeros(n + 1, dtype=bool)
    areas = np.bincount(labels.ravel(), minlength=n + 1)
    for i, sl in enumerate(ndi.find_objects(labels), start=1):
        if sl is None:
            continue
        h, w = sl[0].stop - sl[0].start, sl[1].stop - sl[1].start
        keep[i] = areas[i] >= _MIN_GLYPH_AREA and _MIN_GLYPH_HEIGHT <= h <= max_h and w <= max(12, 8 * h)
    strong = keep[labels]
    # Hysteresis: weaker pixels touching a kept glyph belong to it (anti-aliased edges).
    weak = th >= np.maximum(floor * 0.5, 1.5 * local)
    weak |= strong
    wl, _ = ndi.label(weak, structure=np.ones((3, 3), dtype=bool))
    ids = np.unique(wl[strong])
    ids = ids[ids > 0]
    grown = np.isin(wl, ids)
    # A weak region that grew far beyond its glyph is texture, not an anti-aliased edge.
    return np.where(ndi.binary_dilation(strong, iterations=2), grown, strong)


def _line_boxes(mask: np.ndarray) -> list[tuple[int, int, int, int, bool]]:
    """Group glyphs into text-line boxes: glyphs that overlap vertically by half their height and
    are at most ~1.5 glyph heights apart horizontally (letter and word spacing) join one line."""
    from scipy import ndimage as ndi

    labels, _ = ndi.label(mask, structure=np.ones((3, 3), dtype=bool))
    boxes = [(sl[1].start, sl[0].start, sl[1].stop, sl[0].stop) for sl in ndi.find_objects(labels) if sl is not None]
    if not boxes:
        return []
    parent = list(range(len(boxes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0])
    for pos, i in enumerate(order):
        x0, y0, x1, y1 = boxes[i]
        h = y1 - y0
        for j in order[pos + 1 :]:
            u0, v0, u1, v1 = boxes[j]
            reach = 1.5 * max(h, v1 - v0)
            if u0 - x1 > reach:
                break  # sorted by x0: every later box starts further right
            overlap = min(y1, v1) - max(y0, v0)
            if overlap >= 0.5 * min(h, v1 - v0):
                parent[find(j)] = find(i)
    lines: dict[int, list[int]] = {}
    for i in range(len(boxes)):
        lines.setdefault(find(i), []).append(i)
    out = []
    for members in lines.values():
        xs0, ys0, xs1, ys1 = zip(*(boxes[m] for m in members), strict=True)
        box = (min(xs0), min(ys0), max(xs1), max(ys1))
        # Three letters/digits (the least the text rule accepts) are always wider than 1.5 line
        # heights; taller or squarer boxes are specks and texture, not worth an OCR look.
        if (box[2] - box[0]) >= 1.5 * (box[3] - box[1]):
            out.append((*box, _regular(ys0, ys1)))
    return out


def _regular(tops: tuple[int, ...], bottoms: tuple[int, ...]) -> bool:
    """Looks like typeset text: three or more glyphs whose baselines line up and whose heights
    agree (capitals and digits; a few descenders allowed). Speckle grouped into a "line" rarely
    does."""
    if len(tops) < 3:
        return False
    heights = np.array(bottoms, dtype=np.float32) - np.array(tops, dtype=np.float32)
    h = float(np.median(heights))
    on_baseline = np.abs(np.array(bottoms, dtype=np.float32) - float(np.median(bottoms))) <= max(1.0, 0.15 * h)
    same_height = np.abs(heights - h) <= max(1.0, 0.25 * h)
    return bool(on_baseline.mean() >= 0.7 and same_height.mean() >= 0.6)


def _upscale(crop: np.ndarray, height: int, target: int = 48, limit: float = 4.0) -> tuple[np.ndarray, float]:
    from PIL import Image

    scale = min(limit, max(1.0, target / max(1, height)))
    if scale == 1.0:
        return crop, 1.0
    h, w = crop.shape
    img = Image.fromarray(crop).resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
    return np.asarray(img), scale


def line_crop(img8: np.ndarray, box: tuple[int, int, int, int], polarity: str, *, pad: int = 4) -> tuple[np.ndarray, float, int, int]:
    """OCR-ready crop of ``box`` (dark text on white, stretched, upscaled, framed in white).
    Returns (crop, scale, x offset, y offset) where offsets map crop pixels back to the frame:
    ``frame = offset + (crop - 10) / scale``."""
    rows, cols = img8.shape
    x0, y0, x1, y1 = box
    cx0, cy0, cx1, cy1 = max(0, x0 - pad), max(0, y0 - pad), min(cols, x1 + pad), min(rows, y1 + pad)
    crop = img8[cy0:cy1, cx0:cx1].astype(np.float32)
    if polarity == "bright":
        crop = 255.0 - crop
    lo, hi = float(crop.min()), float(crop.max())
    crop = (crop - lo) * (255.0 / (hi - lo)) if hi > lo else np.full(crop.shape, 255.0)
    out, scale = _upscale(crop.astype(np.uint8), y1 - y0)
    # A white frame around the crop: Tesseract drops glyphs that touch the page edge.
    return np.pad(out, CROP_FRAME, constant_values=255), scale, cx0, cy0


CROP_FRAME = 10


def text_candidates(img8: np.ndarray, frame_index: int, *, min_contrast: int = 40, pad: int = 4) -> list[Candidate]:
    """Text-line candidates of one 8-bit frame, bright-on-dark and dark-on-bright.

    The crop handed to OCR is the frame itself (not the binary mask, which fuses small glyphs),
    turned so the text is dark, stretched to the crop's own range and upscaled."""
    out: list[Candidate] = []
    rows, cols = img8.shape
    for polarity, tophat in zip(("bright", "dark"), _tophats(img8), strict=True):
        mask = _glyph_mask(tophat, min_contrast)
        if not mask.any():
            continue
        for x0, y0, x1, y1, regular in _line_boxes(mask):
            h = y1 - y0
            if h < _MIN_GLYPH_HEIGHT or (x1 - x0) < 3:
                continue
            crop, scale, _, _ = line_crop(img8, (x0, y0, x1, y1), polarity, pad=pad)
            out.append(Candidate(frame_index, x0, y0, x1, y1, crop, scale, polarity, regular))
    return out


def full_frame_views(img8: np.ndarray, *, target_min_side: int = 256) -> list[tuple[np.ndarray, float]]:
    """Whole-frame views for OCR (catches text the candidate grouping missed): the frame and its
    inverse, upscaled when small so that small fonts reach a readable height."""
    from PIL import Image

    rows, cols = img8.shape
    scale = min(3.0, max(1.0, target_min_side / max(1, min(rows, cols))))
    base = img8
    if scale > 1.0:
        base = np.asarray(Image.fromarray(img8).resize((round(cols * scale), round(rows * scale)), Image.Resampling.BICUBIC))
    return [(base, scale), (255 - base, scale)]

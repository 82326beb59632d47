"""Synthetic US/SC objects with PHI text rendered into the pixels (PIL), for tests and benchmarks
of ``burned_in: clean``.

:func:`make_image` returns the dataset and a boolean "ink" map (frames, rows, cols) of the pixels
where the text is legible (anti-aliasing coverage > 25 %), so a test can check that the masks
cover all of it and that nothing else changed. Fonts are Pillow's built-in scalable font: no
system fonts and no downloads."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pydicom
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import UID, ExplicitVRLittleEndian, generate_uid

US_CLASS = "1.2.840.10008.5.1.4.1.1.6.1"
US_MULTIFRAME_CLASS = "1.2.840.10008.5.1.4.1.1.3.1"
SC_CLASS = "1.2.840.10008.5.1.4.1.1.7"


@dataclass(frozen=True)
class Text:
    text: str
    x: int
    y: int
    size: int = 16
    value: float = 1.0  # fraction of full scale (bright text); < 0 means dark text of that depth


def background(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Float image in 0..1: ``gradient`` (shaded + noise), ``noise`` or ``speckle`` (US sector)."""
    yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
    if kind == "gradient":
        return np.clip(0.1 + 0.35 * xx / cols + 0.1 * yy / rows + rng.normal(0, 0.03, (rows, cols)), 0, 1)
    if kind == "noise":
        return np.clip(rng.normal(0.3, 0.06, (rows, cols)), 0, 1)
    if kind == "speckle":
        from scipy import ndimage as ndi

        img = np.full((rows, cols), 0.02, dtype=np.float32)
        speckle = ndi.gaussian_filter(rng.gamma(1.5, 0.2, (rows, cols)).astype(np.float32), 1.2)
        cx, top = cols / 2, -rows * 0.1
        sector = (np.hypot(xx - cx, yy - top) < rows * 0.95) & (np.abs(xx - cx) < (yy - top) * 0.7) & (yy > rows * 0.12)
        img[sector] = np.clip(0.05 + 0.9 * speckle[sector], 0, 0.75)
        return img
    if kind == "flat":
        return np.full((rows, cols), 0.15, dtype=np.float32)
    raise ValueError(kind)


def render(base: np.ndarray, texts: list[Text]) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``texts`` (PIL, anti-aliased) over ``base`` (0..1); returns (image, ink map)."""
    from PIL import Image, ImageDraw, ImageFont

    rows, cols = base.shape
    out = base.copy()
    ink = np.zeros((rows, cols), dtype=bool)
    for t in texts:
        layer = Image.new("L", (cols, rows), 0)
        ImageDraw.Draw(layer).text((t.x, t.y), t.text, fill=255, font=ImageFont.load_default(size=t.size))
        alpha = np.asarray(layer, dtype=np.float32) / 255.0
        target = t.value if t.value >= 0 else 0.0
        out = out * (1 - alpha) + target * alpha if t.value >= 0 else out * (1 - alpha * -t.value)
        ink |= alpha > 0.25  # legible ink; fainter anti-aliasing fringe carries no glyph shape
    return np.clip(out, 0, 1), ink


def make_image(
    texts: list[Text],
    *,
    modality: str = "US",
    rows: int = 240,
    cols: int = 320,
    frames: int = 1,
    rgb: bool = False,
    bits: int = 8,
    bg: str = "gradient",
    seed: int = 0,
    flag: str | None = "YES",
    manufacturer: str = "ACME Imaging",
    model: str = "Synthetica US-9000",
    moving_texts: list[Text] | None = None,
    colour: tuple[float, float, float] | None = None,
) -> tuple[Dataset, np.ndarray]:
    """A US or SC object with ``texts`` burned into every frame (``moving_texts`` into frame i at
    x + 7 i). With ``rgb`` and ``colour`` (0..1 per channel) the text is drawn in that colour on
    the gray image. Returns the dataset (round-tripped through bytes) and the ink map per frame."""
    rng = np.random.default_rng(seed)
    maxval = 255 if bits == 8 else 4095
    planes, inks = [], []
    for f in range(frames):
        base = background(rows, cols, bg, rng)
        extra = [Text(t.text, t.x + 7 * f, t.y, t.size, t.value) for t in (moving_texts or [])]
        img, ink = render(base, texts + extra)
        if rgb and colour is not None:
            img = np.stack(
                [render(base, [Text(t.text, t.x, t.y, t.size, t.value * c) for t in texts + extra])[0] for c in colour],
                axis=-1,
            )
        planes.append(img)
        inks.append(ink)
    arr = np.stack(planes) * maxval
    dtype = np.uint8 if bits == 8 else np.uint16
    arr = np.rint(arr).astype(dtype)
    if rgb and colour is None:
        # coloured images: gray content with a slight tint, text stays gray-white
        arr = np.stack([arr, arr, (arr * 0.9).astype(dtype)], axis=-1)

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    sop_class = SC_CLASS if modality == "SC" else (US_MULTIFRAME_CLASS if frames > 1 else US_CLASS)
    ds.file_meta.MediaStorageSOPClassUID = UID(sop_class)
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = sop_class
    ds.Modality = modality
    ds.PatientName = "DOE^JOHN"
    ds.PatientID = "MRN84412977"
    ds.StudyDate = "20230405"
    ds.StudyInstanceUID = generate_uid()
    ds.SeriesInstanceUID = generate_uid()
    ds.Manufacturer = manufacturer
    ds.ManufacturerModelName = model
    if flag is not None:
        ds.BurnedInAnnotation = flag
    ds.Rows, ds.Columns = rows, cols
    ds.SamplesPerPixel = 3 if rgb else 1
    ds.PhotometricInterpretation = "RGB" if rgb else "MONOCHROME2"
    if rgb:
        ds.PlanarConfiguration = 0
    ds.BitsAllocated = bits
    ds.BitsStored = bits if bits == 8 else 12
    ds.HighBit = ds.BitsStored - 1
    ds.PixelRepresentation = 0
    if bits != 8:
        arr = np.minimum(arr, 4095)
    if frames > 1:
        ds.NumberOfFrames = frames
    ds.PixelData = (arr[0] if frames == 1 else arr).tobytes()
    ds["PixelData"].VR = "OB" if bits == 8 else "OW"
    return roundtrip(ds), np.stack(inks)


def roundtrip(ds: Dataset) -> Dataset:
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return pydicom.dcmread(io.BytesIO(buf.getvalue()))

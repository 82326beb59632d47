"""Burned-in annotation detection (by attribute and modality) and Clean Pixel Data masking."""

from __future__ import annotations

from collections.abc import Iterable

from pydicom.dataset import Dataset

from securetrain.masking.dicom.decoders import gdcm_last_resort
from securetrain.masking.dicom.errors import DeidError, UnreadableDicomError
from securetrain.masking.dicom.policy import PixelMask

gdcm_last_resort()  # JPEG Lossless / JPEG-LS through GDCM; other syntaxes keep their decoders


def burned_in_status(ds: Dataset, suspect_modalities: Iterable[str]) -> str:
    """``"flagged"`` (BurnedInAnnotation=YES), ``"suspected"`` (attribute absent, modality that
    usually burns text in) or ``"no"``. An unknown value of the attribute counts as flagged."""
    value = ds.get("BurnedInAnnotation")
    if value is not None and str(value).strip() != "":
        text = str(value).strip().upper()
        if text == "NO":
            return "no"
        return "flagged"
    modality = str(ds.get("Modality", "") or "").upper()
    if modality in {m.upper() for m in suspect_modalities}:
        return "suspected"
    return "no"


def matching_masks(ds: Dataset, masks: Iterable[PixelMask]) -> list[PixelMask]:
    modality = str(ds.get("Modality", "") or "")
    rows, cols = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
    return [m for m in masks if m.matches(modality, rows, cols)]


def apply_pixel_masks(ds: Dataset, masks: Iterable[PixelMask]) -> None:
    """Zero every rectangle in every frame and sample. Compressed pixel data is decoded and the
    object is written uncompressed (Explicit VR Little Endian): re-compressing lossy data would
    alter it. The pixels are written in the form they were decoded to, and the header follows
    them (burned_in.codec.write_pixels): colour becomes RGB with Planar Configuration 0 (planar
    and YBR input, 4:2:2 included), and pixels that ever went through lossy compression keep
    Lossy Image Compression 01."""
    from securetrain.masking.dicom.burned_in.codec import decode_frames, paint, write_pixels
    from securetrain.masking.dicom.burned_in.regions import Region
    from securetrain.masking.dicom.errors import BurnedInAnnotationError

    if int(ds.get("BitsAllocated", 8) or 8) == 1:
        raise DeidError("Clean Pixel Data does not support 1-bit pixel data")
    try:
        frames = decode_frames(ds)
    except BurnedInAnnotationError as exc:
        if "shape does not match" in str(exc):
            raise DeidError("pixel data shape does not match Rows/Columns/NumberOfFrames") from None
        raise UnreadableDicomError(
            f"cannot decode pixel data to mask it ({str(exc).split(' (hint:')[0]})",
            hint="install a decoder plugin for this transfer syntax (e.g. pylibjpeg) or reject such files",
        ) from None
    regions = [Region(x0, y0, x1, y1, source="pixel_mask") for mask in masks for x0, y0, x1, y1 in mask.rects]
    write_pixels(ds, paint(frames, regions, 0), uncompressed=True)

"""Burned-in annotation detection (by attribute and modality) and Clean Pixel Data masking."""

from __future__ import annotations

from collections.abc import Iterable

from pydicom.dataset import Dataset
from pydicom.uid import ExplicitVRLittleEndian

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
    """Zero every rectangle in every frame. Compressed pixel data is decoded and the object is
    re-encoded uncompressed (Explicit VR Little Endian): re-compressing lossy data would alter it."""
    tsyntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    try:
        if tsyntax is not None and tsyntax.is_compressed:
            ds.decompress(generate_instance_uid=False)
        arr = ds.pixel_array.copy()
    except Exception as exc:
        raise UnreadableDicomError(
            f"cannot decode pixel data to mask it ({type(exc).__name__})",
            hint="install a decoder plugin for this transfer syntax (e.g. pylibjpeg) or reject such files",
        ) from None
    if int(ds.get("BitsAllocated", 8)) == 1:
        raise DeidError("Clean Pixel Data does not support 1-bit pixel data")
    rows, cols = int(ds.Rows), int(ds.Columns)
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    view = arr.reshape((frames, rows, cols, samples)) if arr.size == frames * rows * cols * samples else None
    if view is None:
        raise DeidError("pixel data shape does not match Rows/Columns/NumberOfFrames")
    for mask in masks:
        for x0, y0, x1, y1 in mask.rects:
            view[:, min(y0, rows) : min(y1, rows), min(x0, cols) : min(x1, cols), :] = 0
    ds.PixelData = view.reshape(arr.shape).tobytes()
    if tsyntax is not None and tsyntax.is_compressed:
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds["PixelData"].VR = "OB" if int(ds.get("BitsAllocated", 8)) <= 8 else "OW"

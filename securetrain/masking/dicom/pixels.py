"""Burned-in annotation detection (by attribute and modality) and Clean Pixel Data masking."""

from __future__ import annotations

from collections.abc import Iterable

from pydicom.dataset import Dataset

from securetrain.masking.dicom.decoders import gdcm_last_resort
from securetrain.masking.dicom.errors import DeidError, UnreadableDicomError
from securetrain.masking.dicom.policy import PixelMask

gdcm_last_resort()  # JPEG Lossless / JPEG-LS through GDCM; other syntaxes keep their decoders


# Storage SOP classes whose objects come from devices that burn text in, with the modality they
# stand for in ``burned_in_modalities``. A Secondary Capture object often carries its source's
# Modality (a CT dose report or screen save is SC with Modality CT), and Modality can be missing.
_SOP_CLASS_MODALITY = {
    "1.2.840.10008.5.1.4.1.1.7": "SC",  # Secondary Capture Image
    "1.2.840.10008.5.1.4.1.1.7.1": "SC",  # Multi-frame Single Bit SC
    "1.2.840.10008.5.1.4.1.1.7.2": "SC",  # Multi-frame Grayscale Byte SC
    "1.2.840.10008.5.1.4.1.1.7.3": "SC",  # Multi-frame Grayscale Word SC
    "1.2.840.10008.5.1.4.1.1.7.4": "SC",  # Multi-frame True Color SC
    "1.2.840.10008.5.1.4.1.1.6": "US",  # Ultrasound Image (retired)
    "1.2.840.10008.5.1.4.1.1.6.1": "US",  # Ultrasound Image
    "1.2.840.10008.5.1.4.1.1.6.2": "US",  # Enhanced US Volume
    "1.2.840.10008.5.1.4.1.1.3": "US",  # Ultrasound Multi-frame Image (retired)
    "1.2.840.10008.5.1.4.1.1.3.1": "US",  # Ultrasound Multi-frame Image
    "1.2.840.10008.5.1.4.1.1.77.1.1": "ES",  # VL Endoscopic Image
    "1.2.840.10008.5.1.4.1.1.77.1.1.1": "ES",  # Video Endoscopic Image
    "1.2.840.10008.5.1.4.1.1.77.1.2": "GM",  # VL Microscopic Image
    "1.2.840.10008.5.1.4.1.1.77.1.2.1": "GM",  # Video Microscopic Image
    "1.2.840.10008.5.1.4.1.1.77.1.3": "SM",  # VL Slide-Coordinates Microscopic Image
    "1.2.840.10008.5.1.4.1.1.77.1.6": "SM",  # VL Whole Slide Microscopy Image
    "1.2.840.10008.5.1.4.1.1.77.1.4": "XC",  # VL Photographic Image
    "1.2.840.10008.5.1.4.1.1.77.1.4.1": "XC",  # Video Photographic Image
    "1.2.840.10008.5.1.4.1.1.12.1": "XA",  # X-Ray Angiographic Image
    "1.2.840.10008.5.1.4.1.1.12.1.1": "XA",  # Enhanced XA Image
    "1.2.840.10008.5.1.4.1.1.12.3": "XA",  # X-Ray Angiographic Bi-Plane Image (retired)
    "1.2.840.10008.5.1.4.1.1.12.2": "RF",  # X-Ray Radiofluoroscopic Image
    "1.2.840.10008.5.1.4.1.1.12.2.1": "RF",  # Enhanced XRF Image
}


def burned_in_status(ds: Dataset, suspect_modalities: Iterable[str]) -> str:
    """``"flagged"`` (BurnedInAnnotation=YES), ``"suspected"`` (attribute absent, and the modality
    -- or the modality the SOP class stands for -- usually burns text in) or ``"no"``. An unknown
    value of the attribute counts as flagged."""
    value = ds.get("BurnedInAnnotation")
    if value is not None and str(value).strip() != "":
        text = str(value).strip().upper()
        if text == "NO":
            return "no"
        return "flagged"
    return "suspected" if usually_burned_in(ds, suspect_modalities) else "no"


def usually_burned_in(ds: Dataset, suspect_modalities: Iterable[str]) -> bool:
    """Whether ``ds``'s Modality, or the modality its SOP class stands for, is one of
    ``suspect_modalities`` (those whose devices usually burn text into the pixels)."""
    suspects = {m.strip().upper() for m in suspect_modalities}
    modality = str(ds.get("Modality", "") or "").strip().upper()
    if modality in suspects:
        return True
    meta = getattr(ds, "file_meta", None)
    for sop_class in (ds.get("SOPClassUID"), meta.get("MediaStorageSOPClassUID") if meta is not None else None):
        implied = _SOP_CLASS_MODALITY.get(str(sop_class or "").strip("\x00 "))
        if implied is not None and implied in suspects:
            return True
    return False


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
    from securetrain.masking.dicom.burned_in.codec import (
        decode_frames,
        paint,
        refuse_unconvertible_colour,
        write_pixels,
    )
    from securetrain.masking.dicom.burned_in.regions import Region
    from securetrain.masking.dicom.errors import BurnedInAnnotationError

    if int(ds.get("BitsAllocated", 8) or 8) == 1:
        raise DeidError("Clean Pixel Data does not support 1-bit pixel data")
    refuse_unconvertible_colour(ds)  # a rejection naming the colour space, not an "undecodable" quarantine
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

"""Decode pixel data to frames, paint masks, and re-encode so the output stays valid DICOM.

Transfer syntax rules after masking (nothing is re-encoded when nothing was masked):

* native (uncompressed) input: written back in the same transfer syntax (big endian becomes
  Explicit VR Little Endian);
* lossless compressed input (RLE, JPEG 2000 lossless, ...): re-encoded in the same syntax when
  pydicom has an encoder for it, else written as Explicit VR Little Endian;
* lossy compressed input (JPEG baseline/extended, JPEG 2000, ...): re-encoded *losslessly*
  (JPEG 2000 Lossless when available, else Explicit VR Little Endian) so that masking adds no
  second generation of loss. Lossy Image Compression (0028,2110) stays ``01`` (set if it was
  missing): the pixels did go through lossy compression once; its method and ratio are kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from pydicom.dataset import Dataset
from pydicom.uid import UID, ExplicitVRBigEndian, ExplicitVRLittleEndian, JPEG2000Lossless

from securetrain.masking.dicom.burned_in.regions import Region
from securetrain.masking.dicom.colour import (
    PALETTE_COLOR,
    RGB_CONVERTIBLE_YBR,
    SUPPORTED,
    describe,
    palette,
    photometric,
    unconvertible_colour,
)
from securetrain.masking.dicom.decoders import gdcm_last_resort
from securetrain.masking.dicom.errors import BurnedInAnnotationError, PaletteColorError

gdcm_last_resort()  # JPEG Lossless / JPEG-LS through GDCM; other syntaxes keep their decoders

_LOSSY = frozenset(
    {
        "1.2.840.10008.1.2.4.50",  # JPEG Baseline
        "1.2.840.10008.1.2.4.51",  # JPEG Extended
        "1.2.840.10008.1.2.4.81",  # JPEG-LS Near-Lossless
        "1.2.840.10008.1.2.4.91",  # JPEG 2000 (lossy allowed)
        "1.2.840.10008.1.2.4.203",  # HTJ2K (lossy allowed)
        "1.2.840.10008.1.2.4.93",  # JPEG 2000 Part 2 multi-component (lossy allowed)
    }
)


def transfer_syntax(ds: Dataset) -> UID:
    meta = getattr(ds, "file_meta", None)
    ts = getattr(meta, "TransferSyntaxUID", None)
    if ts is None:
        implicit, little = ds.original_encoding if ds.original_encoding[0] is not None else (False, True)
        from pydicom.uid import ImplicitVRLittleEndian

        return ImplicitVRLittleEndian if implicit else (ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
    return UID(str(ts))


def unconvertible_colour_error(description: str) -> BurnedInAnnotationError:
    """The refusal of colour that cannot be masked (``description``: :func:`colour.describe`):
    names the colour space and bit depth, what is supported and the ways out."""
    return BurnedInAnnotationError(
        f"cannot mask {description}: {SUPPORTED}, and masked colour is written as RGB",
        hint="convert these objects to 8-bit RGB with an imaging toolkit before de-identification; otherwise "
             "they stay refused (or, with burned_in: allow-flagged, are passed on unmasked and still flagged)",
    )


def refuse_unconvertible_colour(ds: Dataset) -> None:
    """Refuse YBR colour that nothing here turns into RGB, before decoding (a 16-bit YBR_FULL
    decode fails with a ValueError that reads like a missing decoder)."""
    try:
        compressed = transfer_syntax(ds).is_compressed
    except ValueError:  # private or unknown syntax: the decoder step reports it
        return
    description = unconvertible_colour(ds, compressed=compressed)
    if description is not None:
        raise unconvertible_colour_error(description)


def decode_frames(ds: Dataset) -> np.ndarray:
    """All frames as ``(frames, rows, columns, samples)``; colour that is stored as YBR arrives as RGB.

    The colour space is taken from what the decoder reports about the array it returned (not
    assumed from the header, and whatever ``pixel_array_options`` the caller set on ``ds``):
    YBR_FULL / YBR_FULL_422 are converted to RGB, a decoder's YBR_ICT / YBR_RCT output is already
    RGB, and any other YBR form (YBR_PARTIAL_422 / _420, YBR with more than 8 bits) is refused before
    decoding, naming it (:func:`refuse_unconvertible_colour`) -- :func:`write_pixels` labels colour it
    writes back as RGB, so it must be RGB.

    Refuses (with the reason) what cannot be masked safely: no decoder, 1-bit or float data,
    a shape that does not match the header."""
    if "PixelData" not in ds:
        raise BurnedInAnnotationError("burned-in text check needs (7FE0,0010) Pixel Data; float/double pixel data is not supported")
    if int(ds.get("BitsAllocated", 8) or 8) == 1:
        raise BurnedInAnnotationError("cannot clean burned-in text in 1-bit pixel data")
    ts = transfer_syntax(ds)
    header_pi = str(ds.get("PhotometricInterpretation", "") or "").strip().upper()
    refuse_unconvertible_colour(ds)
    try:
        from pydicom.pixels import get_decoder

        # as_rgb explicitly: the caller's pixel_array_options (e.g. as_rgb=False) must not decide
        # which colour space ends up under the RGB label
        options: dict[str, Any] = {"as_rgb": True}  # (pydicom types **kwargs as the whole options dict)
        arr, meta = get_decoder(ts).as_array(ds, **options)
    except Exception as exc:
        raise BurnedInAnnotationError(
            f"cannot decode pixel data ({ts.name}: {type(exc).__name__}) to look for burned-in text",
            hint="install a pydicom decoder for this transfer syntax (python-gdcm, pylibjpeg, pylibjpeg-openjpeg, pylibjpeg-rle)",
        ) from None
    rows, cols = int(ds.Rows), int(ds.Columns)
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    if arr.size != frames * rows * cols * samples:
        raise BurnedInAnnotationError("pixel data shape does not match Rows/Columns/NumberOfFrames/SamplesPerPixel")
    arr = arr.reshape((frames, rows, cols, samples))
    decoded_pi = str(meta.get("photometric_interpretation", header_pi) or header_pi).strip().upper()
    if samples == 3 and decoded_pi.startswith("YBR"):
        if decoded_pi not in RGB_CONVERTIBLE_YBR or arr.dtype != np.uint8:
            raise unconvertible_colour_error(describe(decoded_pi, arr.dtype.itemsize * 8))
        from pydicom.pixels import convert_color_space

        arr = convert_color_space(arr, "YBR_FULL", "RGB")
    return arr


def clear_unused_bits(ds: Dataset) -> bool:
    """Zero the bits of native pixel data outside Bits Stored; ``True`` if any were set.

    Bits above High Bit are not part of the pixel value: decoders (and OCR) ignore them, but
    they are passed on with the bytes, and devices put things there -- garbage, or an embedded
    (retired) overlay plane, i.e. text such as the patient's name drawn into bit 12 of 12-of-16
    bit data. For signed data a copy of the sign bit above High Bit is sign extension, not data,
    and is left alone. Only native little/big endian data is looked at (codecs store Bits Stored
    bits); the check reads the raw bytes and costs nothing when Bits Stored = Bits Allocated.
    Big endian input is rewritten as Explicit VR Little Endian (the rule after masking)."""
    try:
        alloc = int(ds.get("BitsAllocated", 0) or 0)
        stored = int(ds.get("BitsStored", alloc) or alloc)
        high = int(ds.get("HighBit", stored - 1))
        signed = int(ds.get("PixelRepresentation", 0) or 0) == 1
    except (TypeError, ValueError):
        return False
    if alloc not in (8, 16, 32) or not 0 < stored < alloc or not stored - 1 <= high < alloc or "PixelData" not in ds:
        return False
    ts = transfer_syntax(ds)
    try:
        if ts.is_compressed:
            return False
    except ValueError:  # a private or unknown transfer syntax: its pixel layout is not ours to read
        return False
    value = ds.get_item("PixelData").value  # raw bytes; the element is not converted
    if not isinstance(value, bytes | bytearray):
        return False
    size = alloc // 8
    big = ts == ExplicitVRBigEndian
    raw = np.frombuffer(value, np.dtype(f"{'>' if big else '<'}u{size}"), count=len(value) // size)
    low = high + 1 - stored
    if low == 0 and raw.size:  # the usual layout: a range check (two reductions) is enough
        if signed:
            as_signed = raw.view(raw.dtype.str.replace("u", "i"))
            if as_signed.min() >= -(1 << high) and as_signed.max() < (1 << high):
                return False
        elif raw.max() < (1 << stored):
            return False
    mask = ((1 << stored) - 1) << low
    kept = raw & raw.dtype.type(mask)
    if signed:
        above = ((1 << alloc) - 1) & ~((1 << (high + 1)) - 1)
        kept = kept | (((raw >> raw.dtype.type(high)) & raw.dtype.type(1)) * raw.dtype.type(above))
    if np.array_equal(kept, raw):
        return False
    if big:
        write_pixels(ds, decode_frames(ds))  # decoded values carry no unused bits
        return True
    out = kept.astype(raw.dtype, copy=False).tobytes()
    if len(value) % size:
        out += bytes(value[len(out):])
    ds.PixelData = out
    ds["PixelData"].VR = "OB" if alloc == 8 else "OW"
    return True


def fill_value(ds: Dataset, frames: np.ndarray) -> int | float:
    """The "black" of this image: the darkest displayed value (MONOCHROME1 shows high as dark;
    PALETTE COLOR: the index whose palette entry is darkest)."""
    pi = photometric(ds)
    if pi == "MONOCHROME1":
        return frames.max()
    if pi == PALETTE_COLOR:
        used = np.unique(frames)
        rgb = displayed(ds, used.reshape(1, -1, 1)).reshape(-1, 3).astype(np.float64)
        return used[int(np.argmin(rgb @ np.array([0.299, 0.587, 0.114])))]
    return frames.min() if pi.startswith("MONOCHROME") else 0


def displayed(ds: Dataset, frames: np.ndarray) -> np.ndarray:
    """What a viewer shows, for OCR: PALETTE COLOR indexes go through the palette (they are not
    intensities; a LUT need not be monotonic); everything else is already displayable."""
    if photometric(ds) != PALETTE_COLOR:
        return frames
    try:
        return palette(ds).apply(frames[..., 0])  # the loader's palette reading (colour.palette)
    except PaletteColorError as exc:
        raise BurnedInAnnotationError(f"cannot apply the palette to look for burned-in text: {str(exc).split(' (hint:')[0]}",
                                      hint=exc.hint) from None


def paint(frames: np.ndarray, regions: Iterable[Region], value: int | float) -> np.ndarray:
    """A copy of ``frames`` with every region set to ``value`` in every frame and sample."""
    out = frames.copy()
    _, rows, cols, _ = out.shape
    for r in regions:
        out[:, max(0, r.y0) : min(rows, r.y1), max(0, r.x0) : min(cols, r.x1), :] = value
    return out


def _encoder_available(ts: UID) -> bool:
    from pydicom.pixels import get_encoder

    try:
        return bool(get_encoder(ts).is_available)
    except (ValueError, NotImplementedError, KeyError):
        return False


def target_syntax(original: UID) -> UID:
    """Where masked pixels are written (see the module docstring)."""
    if not original.is_compressed:
        return ExplicitVRLittleEndian if original == ExplicitVRBigEndian else original
    if str(original) in _LOSSY:
        return JPEG2000Lossless if _encoder_available(JPEG2000Lossless) else ExplicitVRLittleEndian
    return original if _encoder_available(original) else ExplicitVRLittleEndian


def _as_allocated(arr: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    """``arr`` as little-endian samples of the header's Bits Allocated (a decoder may return a
    narrower or wider type than the header names, e.g. 8-bit samples for Bits Allocated 16), so
    the bytes written are exactly what the header says; values that do not fit are refused."""
    if arr.dtype.kind not in "iu" or bits not in (8, 16, 32, 64):
        return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
    want = np.dtype(f"<{'i' if signed else 'u'}{bits // 8}")
    if arr.dtype != want and arr.size:
        info = np.iinfo(want)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise BurnedInAnnotationError(
                f"decoded pixel values do not fit Bits Allocated {bits} (pixel representation {int(signed)})"
            )
    return np.ascontiguousarray(arr.astype(want, copy=False))


def write_pixels(ds: Dataset, masked: np.ndarray, *, uncompressed: bool = False) -> UID:
    """Store ``masked`` (frames, rows, cols, samples) as the object's pixel data; returns the
    transfer syntax written. Raises :class:`BurnedInAnnotationError` if it cannot be encoded.
    ``uncompressed``: compressed input is written as Explicit VR Little Endian (Clean Pixel Data's
    fixed ``pixel_masks``) instead of by :func:`target_syntax`."""
    original = transfer_syntax(ds)
    target = target_syntax(original)
    if uncompressed and target.is_compressed:
        target = ExplicitVRLittleEndian
    was_lossy = str(original) in _LOSSY or str(ds.get("LossyImageCompression", "")).strip() == "01"
    frames, rows, cols, samples = masked.shape
    arr = masked[0] if frames == 1 else masked
    if samples == 1:
        arr = arr[..., 0]
    # The decoded array is native: colour is RGB (decode_frames converts every YBR form or
    # refuses it) and interleaved, whatever the source said.
    if samples == 3:
        if str(ds.get("PhotometricInterpretation", "")).strip().upper().startswith("YBR"):
            ds.PhotometricInterpretation = "RGB"
        ds.PlanarConfiguration = 0
    for tag in ("ExtendedOffsetTable", "ExtendedOffsetTableLengths"):
        if tag in ds:
            del ds[tag]
    bits = int(ds.get("BitsAllocated", 8) or 8)
    arr = _as_allocated(arr, bits, int(ds.get("PixelRepresentation", 0) or 0) == 1)
    ds.PixelData = arr.tobytes()
    ds["PixelData"].VR = "OB" if bits <= 8 else "OW"
    ds["PixelData"].is_undefined_length = False
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    if target.is_compressed:
        try:
            ds.compress(target, arr, generate_instance_uid=False)
        except Exception as exc:
            raise BurnedInAnnotationError(
                f"masked pixel data cannot be re-encoded as {target.name} ({type(exc).__name__})"
            ) from None
    else:
        ds.file_meta.TransferSyntaxUID = target
    if was_lossy:
        ds.LossyImageCompression = "01"
    return target

"""Which stored colour spaces can be turned into RGB here, and the reason when one cannot.

pydicom's ``convert_color_space`` converts 8-bit YBR_FULL and YBR_FULL_422 only (it refuses any
other sample width); JPEG 2000 decoders hand back RGB for YBR_ICT / YBR_RCT themselves.
YBR_PARTIAL_422 is retired and YBR_PARTIAL_420 exists only inside MPEG video: nothing here
converts them. Masking writes colour back as RGB and DicomDataset feeds RGB channels to models, so
colour that cannot be converted is refused -- by name, with what to do -- never passed on as
"RGB" or reported as a missing decoder.
"""

from __future__ import annotations

from pydicom.dataset import Dataset

RGB_CONVERTIBLE_YBR = frozenset({"YBR_FULL", "YBR_FULL_422"})
# JPEG 2000's colour transforms: its decoders return RGB.
DECODER_CONVERTED_YBR = frozenset({"YBR_ICT", "YBR_RCT"})
SUPPORTED = "only 8-bit YBR_FULL / YBR_FULL_422 can be converted to RGB (pydicom)"


def describe(photometric: str, bits: int) -> str:
    """``YBR_FULL colour pixel data (16-bit)``: the colour space and sample width, never a value."""
    return f"{photometric} colour pixel data ({bits}-bit)"


def unconvertible_colour(ds: Dataset, *, compressed: bool) -> str | None:
    """``describe(...)`` of ``ds``'s colour when it is YBR that cannot become RGB here, else None.
    ``compressed``: whether the transfer syntax is compressed (YBR_ICT/RCT only exist there)."""
    if int(ds.get("SamplesPerPixel", 1) or 1) != 3:
        return None
    photometric = str(ds.get("PhotometricInterpretation", "") or "").strip().upper()
    if not photometric.startswith("YBR") or (compressed and photometric in DECODER_CONVERTED_YBR):
        return None
    bits = int(ds.get("BitsAllocated", 8) or 8)
    if photometric in RGB_CONVERTIBLE_YBR and bits == 8:
        return None
    return describe(photometric, bits)

"""Which stored colour spaces can be turned into RGB here, and the reason when one cannot.

pydicom's ``convert_color_space`` converts 8-bit YBR_FULL and YBR_FULL_422 only (it refuses any
other sample width); JPEG 2000 decoders hand back RGB for YBR_ICT / YBR_RCT themselves.
YBR_PARTIAL_422 is retired and YBR_PARTIAL_420 exists only inside MPEG video: nothing here
converts them. Masking writes colour back as RGB and DicomDataset feeds RGB channels to models, so
colour that cannot be converted is refused -- by name, with what to do -- never passed on as
"RGB" or reported as a missing decoder.

PALETTE COLOR (one sample per pixel: an index into red, green and blue lookup tables) is shown
through its palette (:func:`palette`), by DicomDataset and by the burned-in text check alike.
pydicom's ``apply_color_lut`` is not used for plain palettes: it reads big endian palette data
byte-swapped and, with 8-bit entries, wraps indexes above 255 instead of clamping them; it still
expands segmented palettes (16-bit entries), each in its true byte order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import UID, ExplicitVRBigEndian, ExplicitVRLittleEndian

from securetrain.masking.dicom.errors import PaletteColorError

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


PALETTE_COLOR = "PALETTE COLOR"
_COLOURS = ("Red", "Green", "Blue")
_PALETTE_HINT = ("convert these files to RGB with an imaging toolkit, or leave them out; nothing here guesses "
                 "a palette")


def photometric(ds: Dataset) -> str:
    return str(ds.get("PhotometricInterpretation", "") or "").strip().upper()


def little_endian(ds: Dataset) -> bool | None:
    """The byte order of ``ds``'s raw OW values: as read (a file's transfer syntax may be changed
    later, e.g. by masking, without swapping them), else its transfer syntax; None if unknown."""
    if ds.original_encoding[1] is not None:
        return bool(ds.original_encoding[1])
    meta = getattr(ds, "file_meta", None)
    ts = meta.get("TransferSyntaxUID") if meta is not None else None
    try:
        return None if ts is None else bool(UID(str(ts)).is_little_endian)
    except ValueError:  # private or unknown transfer syntax
        return None


@dataclass(frozen=True, eq=False)
class Palette:
    """A PALETTE COLOR image's lookup table: ``table[i]`` is the R, G, B of stored value ``first + i``
    (``uint8`` or ``uint16``, as stored)."""

    first: int
    table: np.ndarray

    def apply(self, indexes: np.ndarray) -> np.ndarray:
        """RGB ``[..., 3]``; values below ``first`` take the first entry, values past the end the
        last (PS3.3 C.7.6.3.1.5)."""
        if indexes.dtype.kind not in "iu":
            raise PaletteColorError(f"{PALETTE_COLOR} pixel data is not integer ({indexes.dtype})", hint=_PALETTE_HINT)
        at = np.clip(indexes.astype(np.int64) - self.first, 0, len(self.table) - 1)
        return self.table[at]


def _refuse(what: str) -> PaletteColorError:
    return PaletteColorError(f"{PALETTE_COLOR} image: {what}", hint=_PALETTE_HINT)


def palette(ds: Dataset) -> Palette:
    """``ds``'s palette (Palette Color Lookup Table Module, plain or segmented); raises
    :class:`PaletteColorError` naming the defect when it cannot be read exactly."""
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    if samples != 1:
        raise _refuse(f"{samples} samples per pixel (one index per pixel expected)")
    descriptors = [ds.get(f"{c}PaletteColorLookupTableDescriptor") for c in _COLOURS]
    if any(d is None or len(d) != 3 for d in descriptors):
        raise _refuse("a red, green or blue palette descriptor is missing or not three numbers")
    values = [tuple(int(v) for v in d) for d in descriptors]
    if len(set(values)) != 1:
        raise _refuse("the red, green and blue palette descriptors differ")
    entries, first, bits = values[0]
    entries = entries % 65536 or 65536  # 0 means 2^16 (read as SS it may be negative)
    if int(ds.get("PixelRepresentation", 0) or 0) == 1 and first >= 32768:
        first -= 65536  # signed indexes: the first mapped value is signed too (US/SS ambiguity)
    if bits not in (8, 16):
        raise _refuse(f"{bits}-bit palette entries (8 or 16 expected)")
    little = little_endian(ds)
    plain = [ds.get(f"{c}PaletteColorLookupTableData") for c in _COLOURS]
    segmented = [ds.get(f"Segmented{c}PaletteColorLookupTableData") for c in _COLOURS]
    if all(isinstance(v, bytes | bytearray) for v in plain):
        table = _plain_table([bytes(v) for v in plain], entries, bits, little)
    elif all(isinstance(v, bytes | bytearray) for v in segmented):
        table = _segmented_table(ds, entries, bits, little)
    else:
        raise _refuse("red, green and blue palette data are not all present (plain or segmented)")
    return Palette(first, table)


def _plain_table(data: list[bytes], entries: int, bits: int, little: bool | None) -> np.ndarray:
    sizes = {len(d) for d in data}
    if len(sizes) != 1:
        raise _refuse("the red, green and blue palette data differ in length")
    size = sizes.pop()
    if size in (entries * bits // 8, entries * bits // 8 + 1):  # (+1: an odd count of bytes is padded)
        width = bits // 8
    elif bits == 8 and size == 2 * entries:  # 8-bit entries stored in 16-bit words (PS3.3 C.7.6.3.1.5, note)
        width = 2
    else:
        raise _refuse(f"palette data holds {size} bytes for {entries} entries of {bits} bits")
    if width == 2 and little is None:
        raise _refuse("the byte order of the palette data is unknown (no transfer syntax)")
    dtype = np.dtype(np.uint8) if width == 1 else np.dtype("<u2" if little else ">u2")
    table = np.stack([np.frombuffer(d, dtype, count=entries) for d in data], axis=-1)
    return table.astype(np.uint8 if width == 1 else np.uint16)


def _segmented_table(ds: Dataset, entries: int, bits: int, little: bool | None) -> np.ndarray:
    """Expanded by pydicom (discrete, linear and indirect segments), given the byte order the data
    was read in; every entry up to ``entries`` must be defined."""
    from pydicom.pixels import apply_color_lut

    if bits != 16:
        # PS3.3 C.7.9.2 codes segments in 16-bit words; readers disagree on 8-bit entries
        raise _refuse("a segmented palette with 8-bit entries (only 16-bit entries are read)")
    if little is None:
        raise _refuse("the byte order of the segmented palette data is unknown (no transfer syntax)")
    lut = Dataset()  # only the palette, in its own byte order; indexes counted from 0
    lut.file_meta = FileMetaDataset()
    lut.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian if little else ExplicitVRBigEndian
    for colour in _COLOURS:
        lut.add_new(f"{colour}PaletteColorLookupTableDescriptor", "US", [entries % 65536, 0, 16])
        lut.add_new(f"Segmented{colour}PaletteColorLookupTableData", "OW",
                    ds[f"Segmented{colour}PaletteColorLookupTableData"].value)
    try:
        table = apply_color_lut(np.arange(entries), lut)
    except (ValueError, IndexError, TypeError, struct.error) as exc:
        raise _refuse(f"the segmented palette cannot be expanded to {entries} entries ({type(exc).__name__})") from None
    return np.asarray(table, dtype=np.uint16)

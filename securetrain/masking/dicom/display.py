"""What a viewer shows, as the training loaders hand it to a model.

Stored pixel values are not yet an image: grey values go through the Modality LUT (Rescale Slope
and Intercept, or a Modality LUT Sequence, PS3.3 C.11.1) and MONOCHROME1 shows low values bright;
PALETTE COLOR values are indexes into a colour palette (:func:`colour.palette`). The VOI LUT
(windowing) is not applied: the loaders scale each image's own min/max to ``[0, 1]`` instead.
A :class:`Display` is built once from a file's (de-identified) header -- every defect is found
then, when the index is built -- and cached with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from securetrain.masking.dicom.colour import PALETTE_COLOR, Palette, little_endian, palette, photometric
from securetrain.masking.dicom.errors import DeidError


def single_float(ds: Any, keyword: str, default: float) -> float:
    """A Rescale Slope/Intercept as one number; multi-valued or non-numeric is a data error."""
    value = ds.get(keyword, None)
    if value is None or value == "":
        return default
    if isinstance(value, list | tuple) or type(value).__name__ == "MultiValue":
        raise DeidError(f"{keyword} is multi-valued ({len(value)} values); one value expected")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise DeidError(f"{keyword} is not a number") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise DeidError(f"{keyword} is not finite")
    return out


@dataclass(frozen=True, eq=False)
class ModalityLut:
    """A Modality LUT Sequence's table: ``table[i]`` is the value of stored value ``first + i``."""

    first: int
    table: np.ndarray

    def apply(self, arr: np.ndarray) -> np.ndarray:
        at = np.clip(arr.astype(np.int64) - self.first, 0, len(self.table) - 1)  # clamped, as a palette
        return self.table[at]


def modality_lut(ds: Any) -> ModalityLut | None:
    """The first item of (0028,3000) Modality LUT Sequence, or None; a LUT that does not match its
    descriptor is a :class:`DeidError`."""
    seq = ds.get("ModalityLUTSequence")
    if not seq:
        return None
    item = seq[0]
    descriptor = item.get("LUTDescriptor")
    if "LUTData" not in item or descriptor is None or len(descriptor) != 3:
        raise DeidError("Modality LUT Sequence item lacks LUT Descriptor (three numbers) or LUT Data")
    entries = int(descriptor[0]) % 65536 or 65536
    first = int(descriptor[1])
    if int(ds.get("PixelRepresentation", 0) or 0) == 1 and first >= 32768:
        first -= 65536  # US/SS ambiguity: signed pixels have a signed first mapped value
    value = item["LUTData"].value
    if isinstance(value, bytes | bytearray):  # OW: 16-bit words in the data set's byte order
        little = little_endian(ds)
        if little is None:
            raise DeidError("the byte order of the Modality LUT data is unknown (no transfer syntax)")
        data = np.frombuffer(bytes(value)[: len(value) // 2 * 2], np.dtype("<u2" if little else ">u2"))
    else:
        data = np.asarray(value if isinstance(value, list | tuple) or type(value).__name__ == "MultiValue"
                          else [value], dtype=np.int64)
    if len(data) < entries:
        raise DeidError(f"Modality LUT holds {len(data)} entries; its descriptor says {entries}")
    return ModalityLut(first, np.asarray(data[:entries], dtype=np.float32))


@dataclass(frozen=True, eq=False)
class Display:
    """How one file's decoded pixels become displayed values (see the module docstring)."""

    colour: bool  # [..., H, W, 3] after :meth:`apply`: three samples (RGB as decoded) or a palette
    palette: Palette | None
    slope: float
    intercept: float
    lut: ModalityLut | None
    inverted: bool  # MONOCHROME1

    @classmethod
    def of(cls, ds: Any) -> Display:
        """From a header (pixels need not be loaded); raises :class:`DeidError` (for a palette,
        :class:`PaletteColorError`) naming what cannot be read."""
        pi = photometric(ds)
        if pi == PALETTE_COLOR:
            return cls(True, palette(ds), 1.0, 0.0, None, False)
        if int(ds.get("SamplesPerPixel", 1) or 1) > 1:  # the Modality LUT is for grey images only
            return cls(True, None, 1.0, 0.0, None, False)
        slope, intercept = single_float(ds, "RescaleSlope", 1.0), single_float(ds, "RescaleIntercept", 0.0)
        if slope == 0.0 and "ModalityLUTSequence" not in ds:  # a blank image, never something to train on
            raise DeidError("RescaleSlope is 0: every pixel would show the same value")
        return cls(False, None, slope, intercept, modality_lut(ds), pi == "MONOCHROME1")

    def apply(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` as decoded (any leading frame axis) -> float32 displayed values: grey
        ``[..., H, W]`` (higher is brighter), colour ``[..., H, W, 3]``."""
        if self.palette is not None:
            return self.palette.apply(arr).astype(np.float32)
        if self.colour:
            return np.asarray(arr, dtype=np.float32)
        if self.lut is not None:
            if arr.dtype.kind not in "iu":
                raise DeidError(f"a Modality LUT needs integer pixel data, not {arr.dtype}")
            out = self.lut.apply(arr)
        else:
            out = np.asarray(arr, dtype=np.float32) * np.float32(self.slope) + np.float32(self.intercept)
        # MONOCHROME1: the minimum is shown white; negated, higher is brighter as for MONOCHROME2
        return -out if self.inverted else out

"""A little-endian data set writer that copies still-raw elements byte for byte.

pydicom's ``write_dataset`` wraps every element in its own buffer, context manager and tag
objects; for a de-identified object, where most elements were never decoded, that dominates the
whole pass. Here a raw element whose encoding matches the output is written as header + its
original value bytes, sequences are written with undefined lengths (items and sequence delimited,
valid in every little-endian transfer syntax), and everything else -- decoded values, odd lengths,
undefined-length raw values -- goes through pydicom's own ``write_data_element``. Big endian and
encoding changes are left to pydicom (the caller falls back).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, cast

from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_data_element

_LONG = frozenset({"OB", "OD", "OF", "OL", "OV", "OW", "SQ", "UC", "UN", "UR", "UT", "SV", "UV"})
_SEQ_DELIM = b"\xfe\xff\xdd\xe0\x00\x00\x00\x00"
_ITEM = b"\xfe\xff\x00\xe0\xff\xff\xff\xff"
_ITEM_DELIM = b"\xfe\xff\x0d\xe0\x00\x00\x00\x00"
_IMPLICIT = struct.Struct("<HHI")
_EXPLICIT_SHORT = struct.Struct("<HH2sH")
_EXPLICIT_LONG = struct.Struct("<HH2sHI")


def write_dataset_le(fp: DicomBytesIO, ds: Dataset, implicit: bool, parent_encoding: Any = "iso8859") -> None:
    """Write ``ds`` to ``fp`` (already set to little endian and ``implicit``)."""
    encodings = parent_encoding
    if 0x00080005 in ds._dict:
        encodings = ds.get("SpecificCharacterSet", parent_encoding) or parent_encoding
    write = fp.write
    d = ds._dict
    for tag in sorted(d):
        if (tag & 0xFFFF) == 0 and (tag >> 16) > 6:
            continue  # retired group lengths are never written (PS3.5 7.2)
        elem = d[tag]
        group, element = tag >> 16, tag & 0xFFFF
        if elem.is_raw:
            raw = cast(RawDataElement, elem)  # is_raw: cheaper than isinstance on this hot path
            value = raw.value
            undefined = raw.length == 0xFFFFFFFF
            vr = raw.VR
            if (
                value is None
                or undefined
                or raw.is_implicit_VR != implicit
                or not raw.is_little_endian
                or len(value) % 2
                or (not implicit and (vr is None or len(vr) != 2 or (vr not in _LONG and len(value) > 0xFFFF)))
            ):
                write_data_element(fp, elem, encodings)
                continue
            if implicit:
                write(_IMPLICIT.pack(group, element, len(value)))
            elif vr in _LONG:
                write(_EXPLICIT_LONG.pack(group, element, vr.encode(), 0, len(value)))
            else:
                write(_EXPLICIT_SHORT.pack(group, element, cast(str, vr).encode(), len(value)))
            write(value)
        elif elem.VR == "SQ":
            if implicit:
                write(_IMPLICIT.pack(group, element, 0xFFFFFFFF))
            else:
                write(_EXPLICIT_LONG.pack(group, element, b"SQ", 0, 0xFFFFFFFF))
            for item in cast(Sequence[Dataset], elem.value or ()):
                write(_ITEM)
                write_dataset_le(fp, item, implicit, encodings)
                write(_ITEM_DELIM)
            write(_SEQ_DELIM)
        else:
            write_data_element(fp, elem, encodings)

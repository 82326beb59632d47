"""Specific Character Set (0008,0005) of de-identified output: valid terms, text that decodes.

Real files name their character set wrongly (``ISO-8859-1``, ``UTF8``, ``ISO_IR100``), name none
while holding non-ASCII bytes, or hold Latin-1 bytes under ``ISO_IR 192``. pydicom reads such text
with replacement characters, and writing it back as read leaves an object whose bytes contradict
its declared character set. :func:`repair_character_set` runs after de-identification:

* a misspelt term whose codec is that of one defined term becomes that term (bytes unchanged);
* when any text value does not decode strictly with the (repaired) character set -- non-ASCII bytes
  without one, an unknown term, an invalid combination, bytes the codec rejects -- every text value
  is decoded as pydicom reads it (undecodable bytes become U+FFFD) and the object is written as
  ``ISO_IR 192`` (UTF-8), so the output always decodes with the character set it declares.

Valid objects are left byte for byte as they were.
"""

from __future__ import annotations

import codecs
import warnings
from typing import Any

from pydicom import config
from pydicom.charset import decode_bytes, python_encoding
from pydicom.dataset import Dataset

# VRs whose values the Specific Character Set applies to (PS3.5 6.1.2.3)
_CHARSET_VRS = frozenset({"SH", "LO", "ST", "LT", "UT", "UC", "PN"})
_TAG = 0x00080005
_NO_EXTENSIONS = frozenset({"ISO_IR 192", "GB18030", "GBK"})  # PS3.5 6.1.2.5.4: single-valued only
# candidates for a misspelt term, matched by codec (ISO_IR 6 is ASCII although pydicom reads it as Latin-1)
_SINGLE_BYTE_TERMS = [t for t in python_encoding if t.startswith("ISO_IR ") and t != "ISO_IR 6"] + ["GB18030", "GBK"]


def _codec(name: str) -> str | None:
    try:
        return codecs.lookup(name).name
    except LookupError:
        return None


def _defined_term(term: str) -> str | None:
    """The defined term for a misspelt one (``ISO-8859-1`` -> ``ISO_IR 100``), or None."""
    if term in python_encoding:
        return term
    compact = term.upper().replace(" ", "").replace("-", "").replace("_", "")
    for t in python_encoding:
        if t and t.upper().replace(" ", "").replace("-", "").replace("_", "") == compact:
            return t
    codec = _codec(term)
    if codec is None:
        return None
    for t in _SINGLE_BYTE_TERMS:
        if _codec(python_encoding[t]) == codec:
            return t
    return None


def _terms(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    values = [value] if isinstance(value, str) else list(value)
    return [str(v).strip() for v in values]


def _valid(terms: list[str]) -> bool:
    if any(t not in python_encoding for t in terms):
        return False
    return not (len(terms) > 1 and any(t in _NO_EXTENSIONS for t in terms))


def _strict_ok(value: bytes, terms: list[str]) -> bool:
    if value.isascii() and b"\x1b" not in value:
        return True
    if not terms or terms == ["ISO_IR 6"]:
        return False  # default repertoire: ASCII only
    encodings = [python_encoding[t] for t in terms]
    old = config.settings.reading_validation_mode
    config.settings.reading_validation_mode = config.RAISE
    try:
        decode_bytes(value, encodings, set())
        return True
    except (UnicodeError, LookupError, ValueError):
        return False
    finally:
        config.settings.reading_validation_mode = old


def _scan(ds: Dataset, terms: list[str]) -> bool:
    """True when every text value of ``ds`` (and its items) decodes strictly under ``terms``."""
    if _TAG in ds._dict:
        terms = _raw_terms(ds)  # an item's own character set applies to it and its items
        if not _valid(terms):
            return False
    for tag in list(ds._dict):
        elem: Any = ds._dict[tag]
        if elem.is_raw:
            vr = elem.VR or _dictionary_vr(int(tag))
            if vr == "SQ":
                elem = ds[tag]
            elif vr in _CHARSET_VRS and isinstance(elem.value, bytes | bytearray):
                if not _strict_ok(bytes(elem.value), terms):
                    return False
                continue
            else:
                continue
        if elem.VR == "SQ":
            if not all(_scan(item, terms) for item in elem.value or ()):
                return False
        elif elem.VR in _CHARSET_VRS:
            values = elem.value if isinstance(elem.value, list | tuple) or type(elem.value).__name__ == "MultiValue" else [elem.value]
            for v in values:
                text = str(v) if v is not None else ""
                if "\ufffd" in text:
                    return False
                if (not terms or terms == ["ISO_IR 6"]) and not text.isascii():
                    return False
    return True


def _dictionary_vr(tag: int) -> str:
    from pydicom.datadict import dictionary_VR

    try:
        return str(dictionary_VR(tag))
    except KeyError:
        return "UN"


def _raw_terms(ds: Dataset) -> list[str]:
    if _TAG not in ds._dict:
        return []
    elem: Any = ds.get_item(_TAG)
    value = elem.value
    if isinstance(value, bytes | bytearray):
        return [v.strip() for v in bytes(value).decode("ascii", "replace").split("\\")]
    return _terms(value)


def repair_character_set(ds: Dataset) -> str | None:
    """Make ``ds`` valid for its Specific Character Set (see the module doc). Returns what was done
    (``"renamed"``, ``"transcoded"``) or None when the object was left as it was."""
    terms = _raw_terms(ds)
    renamed = None
    if terms and not _valid(terms):
        fixed = [(_defined_term(t) if t else t) for t in terms]
        if all(f is not None for f in fixed) and _valid([f for f in fixed if f is not None]):
            ds.SpecificCharacterSet = fixed if len(fixed) > 1 else fixed[0]
            terms = [f for f in fixed if f is not None]
            renamed = "renamed"
    if _valid(terms) and _scan(ds, terms):
        return renamed
    _transcode(ds)
    return "transcoded"


def _transcode(ds: Dataset) -> None:
    """Decode every text value as pydicom reads it, then declare UTF-8 (nested items' own
    Specific Character Set included), so the writer encodes all of it as ISO_IR 192."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        items = [ds]
        for elem in ds.iterall():  # converts raw elements with the character set they were read in
            if elem.VR == "SQ":
                items.extend(elem.value or ())
            elif elem.VR in _CHARSET_VRS:
                _ = elem.value
        for item in items:
            for tag in list(item._dict):
                pn: Any = item[tag]
                if pn.VR == "PN":  # PersonName keeps its original bytes: hand the writer plain text
                    values = pn.value if type(pn.value).__name__ == "MultiValue" else [pn.value]
                    texts = [str(v) if v is not None else "" for v in values]
                    pn.value = texts if len(texts) > 1 else texts[0]
            if item is not ds and _TAG in item._dict:
                del item[_TAG]
    ds.SpecificCharacterSet = "ISO_IR 192"

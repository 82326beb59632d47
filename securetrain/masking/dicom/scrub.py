"""Redact removed values from retained free text, at word boundaries, with a per-script length rule.

Needles are the values the profile removed or replaced anywhere in the same object. How a needle
matches depends on what it is:

* **Letters only, alphabetic scripts** (Latin, Greek, Cyrillic, ...): at word boundaries, so the
  needle ``text`` never turns ``Context`` into ``ConXXXX``. A "word" boundary is any non-letter
  (digits, ``_``, ``^``, punctuation, space): ``Smith_J`` and ``Smith2`` still match ``Smith``.
  Needles shorter than 6 characters must be whole words; longer ones need the boundary only at
  their start (a value cut to its VR's maximum length still matches the word it was cut from).
* **Anything with a digit** (IDs, dates, UIDs, accession numbers): as a substring anywhere;
  identifiers are glued into URIs and file names (``...?pid=AB12345``) and there are no words to
  mangle.
* **CJK scripts** (Han, Hiragana, Katakana, Hangul): as a substring (these scripts do not put
  spaces between words).

Length rule per needle (shorter ones would redact ordinary text far more often than names):

* person-name components: >= 2 letters in alphabetic scripts (``LI^WEI`` -> ``Li``, ``Wei``),
  >= 2 characters in CJK; a 1-character CJK component is matched only as part of the whole name
  (family + given, both orders, also written without the separator: ``山田太郎``, ``김민수``);
* every other removed value: >= 4 characters (>= 2 in CJK).

Redaction keeps the text's length (``X`` per character), so values keep fitting their VR.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

MIN_VALUE_LEN = 4
MIN_NAME_PART_LEN = 2
MIN_CJK_LEN = 2
LONG_NEEDLE_LEN = 6


def is_cjk_char(ch: str) -> bool:
    o = ord(ch)
    return (
        0x3040 <= o <= 0x30FF  # Hiragana, Katakana
        or 0x3400 <= o <= 0x4DBF  # CJK Extension A
        or 0x4E00 <= o <= 0x9FFF  # CJK Unified Ideographs
        or 0xF900 <= o <= 0xFAFF  # CJK Compatibility Ideographs
        or 0xAC00 <= o <= 0xD7AF  # Hangul syllables
        or 0x1100 <= o <= 0x11FF  # Hangul Jamo
        or 0x3130 <= o <= 0x318F  # Hangul compatibility Jamo
        or 0xFF66 <= o <= 0xFF9F  # half-width Katakana
        or 0x20000 <= o <= 0x2FA1F  # CJK Extensions B+
    )


def _has_cjk(text: str) -> bool:
    return not text.isascii() and any(is_cjk_char(c) for c in text)


def _letters(text: str) -> int:
    return sum(1 for c in text if c.isalnum())


def value_needles(value: str) -> list[str]:
    """Needles for one removed non-name value (IDs, descriptions, dates, UIDs ...)."""
    s = value.strip().strip("\x00").strip()
    if not s:
        return []
    if _has_cjk(s):
        return [s] if len(s) >= MIN_CJK_LEN else []
    return [s] if len(s) >= MIN_VALUE_LEN else []


def name_needles(value: str) -> list[str]:
    """Needles for one removed person name (PN: ``family^given^middle^prefix^suffix``, up to three
    ``=``-separated groups: alphabetic, ideographic, phonetic)."""
    out: list[str] = []
    whole = value.strip()
    if not whole:
        return out
    out.extend(value_needles(whole.replace("^", " ").strip()))
    for group in whole.split("="):
        parts = [p.strip() for p in group.split("^") if p.strip()]
        # a component may itself hold several words ("van der Berg", "Mary Ann")
        for part in parts:
            words = [part, *part.split()] if " " in part else [part]
            for w in words:
                if _has_cjk(w):
                    if len(w) >= MIN_CJK_LEN:
                        out.append(w)
                elif _letters(w) >= MIN_NAME_PART_LEN:
                    out.append(w)
        if len(parts) >= 2:
            family, given = parts[0], parts[1]
            sep = "" if _has_cjk(family + given) else " "
            out.extend({family + sep + given, given + sep + family, family + given})
    return out


def _is_word_needle(needle: str) -> bool:
    """Alphabetic-script needles match whole words; ones with digits or CJK match anywhere."""
    return not any(c.isdigit() for c in needle) and not _has_cjk(needle)


class Redactor:
    """One compiled matcher for the needles of one object."""

    __slots__ = ("_pattern", "needles")

    def __init__(self, needles: Iterable[str]) -> None:
        uniq = sorted({unicodedata.normalize("NFC", n) for n in needles if n}, key=len, reverse=True)
        self.needles = uniq
        if not uniq:
            self._pattern = None
            return
        parts = []
        for n in uniq:
            esc = re.escape(n)
            if _is_word_needle(n):
                # boundary = not a letter ([^\W\d_] is "a letter" in Unicode regex). Short needles
                # need it on both sides; long ones only at the start, so a value cut to its VR's
                # length ("LightSpeed Ultr") still matches the full word it was cut from.
                tail = "" if len(n) >= LONG_NEEDLE_LEN else r"(?![^\W\d_])"
                parts.append(rf"(?<![^\W\d_]){esc}{tail}")
            else:
                parts.append(esc)
        self._pattern = re.compile("|".join(parts), re.IGNORECASE)

    def __bool__(self) -> bool:
        return self._pattern is not None

    def could_match(self, lowered: str) -> bool:
        """Cheap pre-filter: does any needle occur at all (ignoring boundaries)? Compared in NFC,
        like :meth:`redact` (the needles are NFC), so decomposed text (``u`` + U+0308) still matches."""
        if not lowered.isascii():
            lowered = unicodedata.normalize("NFC", lowered)
        return any(n.lower() in lowered for n in self.needles)

    def redact(self, text: str) -> str:
        if self._pattern is None:
            return text
        nfc = unicodedata.normalize("NFC", text)
        return self._pattern.sub(lambda m: "X" * len(m.group(0)), nfc) if self._pattern.search(nfc) else text

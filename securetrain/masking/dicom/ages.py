"""HIPAA Safe Harbor ages: an Age String (AS) above 89 years becomes the one category ``090Y``.

PS3.15's Retain Patient Characteristics option keeps Patient's Age (0010,1010) as it is; HIPAA
Safe Harbor (45 CFR 164.514(b)(2)(i)(C)) allows ages over 89 only "aggregated into a single
category of age 90 or older". Ages are checked in completed years, in any unit, and values that
break the AS format (more than three digits, lower-case unit, stray spaces) are read leniently
because real devices write ``1100M`` or ``40000D``: the cap must not depend on the writer being
conformant. A value that cannot be read as an age at all is reported as malformed (``None``); the
caller empties it rather than keep a value it could not check.

Ages written into free text the profile keeps ("92 year old female", "92yo", "age 95",
"95-year-old", "Age: 091Y") are aggregated too (:func:`aggregate_text_ages`): only a number that
text marks as an age -- by an age word before it (``age``, ``aged``, ``ages``), a year word after it
(``years``, ``yrs``, ``yo``, ``y/o``, ``y.o.``), or an Age String form (``091Y``, ``age 1100M``) --
so "92 slices" and "series 95" stay. Words ("ninety-two") and age ranges are not recognised.
"""

from __future__ import annotations

import re

#: The single category every age above 89 years is written as.
AGGREGATED_AGE = "090Y"

_AGE_RE = re.compile(r"^(\d+) ?([DWMY])$")
_AS_BYTES_RE = re.compile(rb"\d{3}[DWMY]")
# The fewest days any 90 years have (90 * 365 + 21 leap days): a day or week count at least this
# long may be a 90-year-old, so it is capped (a day early rather than a day late).
_DAYS_IN_90_YEARS = 90 * 365 + 21


def is_over_89(number: int, unit: str) -> bool:
    """Whether ``number`` ``unit`` (D, W, M or Y) is 90 completed years or more."""
    if unit == "Y":
        return number >= 90
    if unit == "M":
        return number >= 90 * 12
    days = number * 7 if unit == "W" else number
    return days >= _DAYS_IN_90_YEARS


def aggregate_age(value: str) -> str | None:
    """The HIPAA-safe form of one AS value: ``090Y`` above 89 years, else the age in the standard
    ``nnnU`` form (``45Y`` -> ``045Y``); ``None`` when ``value`` is not an age (no unit, no number,
    words). An empty value stays empty."""
    text = value.strip(" \x00").upper()
    if not text:
        return ""
    match = _AGE_RE.match(text)
    if match is None:
        return None
    number, unit = int(match.group(1)), match.group(2)
    if is_over_89(number, unit):
        return AGGREGATED_AGE
    # AS has three digits: an over-long count moves to the next coarser unit (completed ones).
    while number > 999:
        number, unit = _COARSER[unit](number)
    return f"{number:03d}{unit}"


_COARSER = {
    "D": lambda days: (days // 7, "W"),
    "W": lambda weeks: (weeks * 7 * 1200 // 36525, "M"),  # a month is 365.25 / 12 days
    "M": lambda months: (months // 12, "Y"),
}


def looks_like_age(value: object) -> bool:
    """Whether an element of unknown VR (a private one read from an Implicit VR file: ``UN``) holds
    exactly one conformant Age String, ``nnnU``: such a value is treated as an age."""
    return isinstance(value, bytes) and _AS_BYTES_RE.fullmatch(value) is not None


#: What an age over 89 written as a number in free text becomes: "92 year old" -> "90+ year old".
AGGREGATED_TEXT_AGE = "90+"

# One pattern for str (re.ASCII) and for raw bytes (a pre-filter before decoding), so both agree
# on ASCII text. Digits are [0-9]: only ASCII digits are read as ages.
_TEXT_AGE = r"""
    (?<![a-z0-9_])ages?d?\s*(?:[:=-]|of\b|is\b)?\s*                 # "age 95", "aged 92", "Age: 091Y"
        (?P<labelled>[0-9]{1,5}(?:\.[0-9]+)?)(?![0-9+])(?!\.[0-9])
        (?P<unit>[dwmy](?![a-z0-9]))?
  | (?<![a-z0-9_.])(?P<token>[0-9]{1,3})y(?![a-z0-9])                # an Age String in text: "093Y"
  | (?<![a-z0-9_.])(?P<years>[0-9]{1,3}(?:\.[0-9]+)?)                # "92 years", "92yo", "95-year-old"
        \s*-?\s*(?:years?|yrs?|y/o|y\.o\.?|yo)(?![a-z])
"""
_TEXT_AGE_RE = re.compile(_TEXT_AGE, re.IGNORECASE | re.ASCII | re.VERBOSE)
_TEXT_AGE_BYTES_RE = re.compile(_TEXT_AGE.encode("ascii"), re.IGNORECASE | re.VERBOSE)


def may_hold_text_age(raw: bytes) -> bool:
    """Whether encoded text (an ASCII-compatible character set) may hold an age: a cheap test on
    the bytes, so text without one is never decoded."""
    return _TEXT_AGE_BYTES_RE.search(raw) is not None


def aggregate_text_ages(text: str, *, max_len: int | None = None) -> tuple[str, int]:
    """``text`` with every age over 89 aggregated, and how many were: a number becomes
    :data:`AGGREGATED_TEXT_AGE` ("90+"), an Age String form (``091Y``, ``age 1100M``)
    :data:`AGGREGATED_AGE`. Where "90+" would make the value longer than ``max_len`` (its VR's
    maximum), "90" is written instead (still the one category). Ages up to 89 are left as written."""
    if not text or not any(c.isdigit() for c in text):
        return text, 0
    new, count = _aggregate(text, AGGREGATED_TEXT_AGE)
    if max_len is not None and len(new) > max_len:
        new, count = _aggregate(text, AGGREGATED_TEXT_AGE.rstrip("+"))
    return new, count


def _aggregate(text: str, number_token: str) -> tuple[str, int]:
    count = 0

    def replace(match: re.Match[str]) -> str:
        nonlocal count
        if match.group("token") is not None:
            group, number, unit, token = "token", match.group("token"), "Y", AGGREGATED_AGE
            end = match.end()  # the unit letter goes too: "093Y" -> "090Y"
        elif match.group("labelled") is not None:
            group, number, unit = "labelled", match.group("labelled"), (match.group("unit") or "Y").upper()
            token = AGGREGATED_AGE if match.group("unit") else number_token
            end = match.end("unit") if match.group("unit") else match.end("labelled")
        else:
            group, number, unit, token = "years", match.group("years"), "Y", number_token
            end = match.end("years")
        whole = int(float(number))  # completed units: 92.5 years is 92
        if unit == "Y" and len(str(whole)) > 3:
            return match.group(0)  # "age 1995": a year, not an age
        if not is_over_89(whole, unit):
            return match.group(0)
        start, offset = match.start(group), match.start()
        out = match.group(0)[: start - offset] + token + match.group(0)[end - offset :]
        count += out != match.group(0)
        return out

    return _TEXT_AGE_RE.sub(replace, text), count

"""HIPAA Safe Harbor ages: an Age String (AS) above 89 years becomes the one category ``090Y``.

PS3.15's Retain Patient Characteristics option keeps Patient's Age (0010,1010) as it is; HIPAA
Safe Harbor (45 CFR 164.514(b)(2)(i)(C)) allows ages over 89 only "aggregated into a single
category of age 90 or older". Ages are checked in completed years, in any unit, and values that
break the AS format (more than three digits, lower-case unit, stray spaces) are read leniently
because real devices write ``1100M`` or ``40000D``: the cap must not depend on the writer being
conformant. A value that cannot be read as an age at all is reported as malformed (``None``); the
caller empties it rather than keep a value it could not check.
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

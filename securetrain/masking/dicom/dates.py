"""Shift DA and DT values by whole days, keeping their precision; TM is never touched.

Only the calendar date moves, so a DT's time-of-day and a separate TM stay coupled with it.
Partial values keep their precision and always change: a day offset smaller than the value's
precision would otherwise leave it as it was (``shift_da("2020", 100)`` would still say 2020), so
``YYYY`` moves by ``round(days / 365.2425)`` years and ``YYYYMM`` by ``round(days / 30.436875)``
months, at least one unit in the offset's direction. A DT's UTC-offset suffix (``&ZZXX``) is
dropped, because the time zone hints at the location. Ranges (``A-B``, ``A-``, ``-B``) shift each
end and keep both. Unparseable values return ``None`` and the caller removes them (fail closed).
"""

from __future__ import annotations

import datetime as _dt
import re

_ONE_DAY = _dt.timedelta(days=1)
_DAYS_PER_YEAR = 365.2425
_DAYS_PER_MONTH = _DAYS_PER_YEAR / 12
# YYYY[MM[DD[HH[MM[SS[.F{1,6}]]]]]][&ZZXX]
_DT = r"\d{4}(?:\d{2}(?:\d{2}(?:\d{2}(?:\d{2}(?:\d{2}(?:\.\d{1,6})?)?)?)?)?)?"
_DT_ONE = re.compile(rf"({_DT})([+-]\d{{4}})?")
_DT_RANGE = re.compile(rf"({_DT})?(?:[+-]\d{{4}})?-({_DT})?(?:[+-]\d{{4}})?")


def _units(days: int, per_unit: float) -> int:
    n = round(days / per_unit)
    if n == 0:
        n = 1 if days > 0 else -1
    return n


def _shift_date_part(text: str, days: int) -> str | None:
    if len(text) not in (4, 6, 8) or not text.isdigit():
        return None
    year = int(text[:4])
    try:
        if len(text) == 4:
            shifted_year = year + _units(days, _DAYS_PER_YEAR)
            return f"{shifted_year:04d}" if 1 <= shifted_year <= 9999 else None
        month = int(text[4:6])
        if len(text) == 6:
            if not 1 <= month <= 12:
                return None
            total = year * 12 + (month - 1) + _units(days, _DAYS_PER_MONTH)
            y, m = divmod(total, 12)
            return f"{y:04d}{m + 1:02d}" if 1 <= y <= 9999 else None
        shifted = _dt.date(year, month, int(text[6:8])) + days * _ONE_DAY
    except (ValueError, OverflowError):
        return None
    return f"{shifted.year:04d}{shifted.month:02d}{shifted.day:02d}"


def shift_da(value: str, days: int) -> str | None:
    value = value.strip()
    if not value:
        return value
    if "-" in value:
        parts = value.split("-")
        if len(parts) != 2 or not any(p.strip() for p in parts):
            return None
        out: list[str] = []
        for part in parts:
            shifted = _shift_date_part(part.strip(), days) if part.strip() else ""
            if shifted is None:
                return None
            out.append(shifted)
        return "-".join(out)
    if "." in value and len(value) == 10:  # ACR-NEMA style YYYY.MM.DD
        value = value.replace(".", "")
    return _shift_date_part(value, days)


def _valid_offset(text: str) -> bool:
    """PS3.5: &ZZXX with -1200 <= offset <= +1400."""
    hours, minutes = int(text[1:3]), int(text[3:5])
    return minutes < 60 and hours <= (14 if text[0] == "+" else 12)


def _shift_dt_one(value: str, days: int) -> str | None:
    m = _DT_ONE.fullmatch(value)
    if not m:
        return None
    body = m.group(1)  # the UTC offset (group 2) is dropped
    head = body[:8] if len(body) >= 8 else body
    if len(head) < 8 and len(body) > len(head):
        return None
    new_head = _shift_date_part(head, days)
    return None if new_head is None else new_head + body[len(head):]


def shift_dt(value: str, days: int) -> str | None:
    value = value.strip()
    if not value:
        return value
    one = _DT_ONE.fullmatch(value)
    if one and (not one.group(2) or _valid_offset(one.group(2))):
        return _shift_dt_one(value, days)  # one value: a trailing -ZZXX is a UTC offset, not a range
    m = _DT_RANGE.fullmatch(value)
    if not m or not (m.group(1) or m.group(2)):
        return None
    low = _shift_dt_one(m.group(1), days) if m.group(1) else ""
    high = _shift_dt_one(m.group(2), days) if m.group(2) else ""
    if low is None or high is None:
        return None
    return f"{low}-{high}"

"""Shift DA and DT values by whole days, keeping their precision; TM is never touched.

Only the calendar date moves, so a DT's time-of-day and a separate TM stay coupled with it.
Partial values keep their precision: ``YYYY`` and ``YYYYMM`` are shifted from their first day
and truncated back. A DT's UTC-offset suffix (``&ZZXX``) is dropped, because the time zone hints
at the location; ranges (``A-B``) shift each end. Unparseable values return ``None`` and the
caller removes them (fail closed).
"""

from __future__ import annotations

import datetime as _dt

_ONE_DAY = _dt.timedelta(days=1)


def _shift_date_part(text: str, days: int) -> str | None:
    if len(text) not in (4, 6, 8) or not text.isdigit():
        return None
    year = int(text[:4])
    month = int(text[4:6]) if len(text) >= 6 else 1
    day = int(text[6:8]) if len(text) == 8 else 1
    try:
        shifted = _dt.date(year, month, day) + days * _ONE_DAY
    except (ValueError, OverflowError):
        return None
    return f"{shifted.year:04d}{shifted.month:02d}{shifted.day:02d}"[: len(text)]


def shift_da(value: str, days: int) -> str | None:
    value = value.strip()
    if not value:
        return value
    if "-" in value:
        parts = value.split("-")
        if len(parts) != 2:
            return None
        out = [(_shift_date_part(p.strip(), days) if p.strip() else "") for p in parts]
        return None if any(o is None for o in out) else "-".join(out)  # type: ignore[arg-type]
    return _shift_date_part(value.replace(".", ""), days) if "." in value and len(value) == 10 else _shift_date_part(value, days)


def shift_dt(value: str, days: int) -> str | None:
    value = value.strip()
    if not value:
        return value
    for sign in "+-":
        pos = value.find(sign, 4)
        if pos != -1 and sign == "-" and len(value) - pos - 1 != 4:
            continue  # a '-' that is not a 4-digit UTC offset: maybe a range, handled below
        if pos != -1:
            value = value[:pos]
            break
    if "-" in value[4:]:
        return None  # DT ranges only occur in queries, never in stored instances
    head = value[:8] if len(value) >= 8 else value
    if len(head) < 8 and len(value) > len(head):
        return None
    new_head = _shift_date_part(head, days)
    if new_head is None:
        return None
    return new_head + value[len(head):]

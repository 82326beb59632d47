"""PS3.15 Table E.1-1 as package data, and its compilation into a fast per-tag action map.

The table ships as ``profile_table.json`` (edition and provenance recorded inside). Compiling
resolves the basic profile code plus the selected options into one *simple* action per tag
(``X Z D U K C``), so the engine does one dict lookup per element; the few tag patterns with
``x`` digits (curves ``50xx,xxxx``, overlays ``60xx,3000``/``60xx,4000``) stay in a short list of
``(mask, value, action)`` triples.

Compound codes are resolved without IOD knowledge, conservatively: never keep the original
value and always stay IOD-conformant whatever the attribute's Type turns out to be:

* ``X/Z``               -> ``Z``  (present but empty satisfies Type 2 and 3)
* ``Z/D``, ``X/D``, ``X/Z/D`` -> ``D`` (a fixed dummy satisfies Type 1, 2 and 3)
* ``X/Z/U*``            -> ``U*``: keep the sequence, recurse, and the UID rows inside it remap
                          the UIDs (references stay consistent with the remapped instances)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from importlib import resources
from typing import Any


class Option(str, Enum):
    RETAIN_SAFE_PRIVATE = "retain_safe_private"
    RETAIN_UIDS = "retain_uids"
    RETAIN_DEVICE_IDENTITY = "retain_device_identity"
    RETAIN_INSTITUTION_IDENTITY = "retain_institution_identity"
    RETAIN_PATIENT_CHARACTERISTICS = "retain_patient_characteristics"
    RETAIN_LONGITUDINAL_FULL_DATES = "retain_longitudinal_full_dates"
    RETAIN_LONGITUDINAL_MODIFIED_DATES = "retain_longitudinal_modified_dates"
    CLEAN_DESCRIPTORS = "clean_descriptors"
    CLEAN_STRUCTURED_CONTENT = "clean_structured_content"
    CLEAN_GRAPHICS = "clean_graphics"
    CLEAN_PIXEL_DATA = "clean_pixel_data"


# CID 7050 De-identification Method codes (scheme DCM).
CID7050: dict[str, tuple[str, str]] = {
    "basic": ("113100", "Basic Application Confidentiality Profile"),
    Option.CLEAN_PIXEL_DATA.value: ("113101", "Clean Pixel Data Option"),
    Option.CLEAN_GRAPHICS.value: ("113103", "Clean Graphics Option"),
    Option.CLEAN_STRUCTURED_CONTENT.value: ("113104", "Clean Structured Content Option"),
    Option.CLEAN_DESCRIPTORS.value: ("113105", "Clean Descriptors Option"),
    Option.RETAIN_LONGITUDINAL_FULL_DATES.value: ("113106", "Retain Longitudinal Temporal Information Full Dates Option"),
    Option.RETAIN_LONGITUDINAL_MODIFIED_DATES.value: (
        "113107",
        "Retain Longitudinal Temporal Information Modified Dates Option",
    ),
    Option.RETAIN_PATIENT_CHARACTERISTICS.value: ("113108", "Retain Patient Characteristics Option"),
    Option.RETAIN_DEVICE_IDENTITY.value: ("113109", "Retain Device Identity Option"),
    Option.RETAIN_UIDS.value: ("113110", "Retain UIDs Option"),
    Option.RETAIN_SAFE_PRIVATE.value: ("113111", "Retain Safe Private Option"),
    Option.RETAIN_INSTITUTION_IDENTITY.value: ("113112", "Retain Institution Identity Option"),
}

SIMPLE_ACTIONS = frozenset({"X", "Z", "D", "U", "K", "C"})
BASIC_CODES = frozenset({"X", "Z", "D", "U", "Z/D", "X/Z", "X/D", "X/Z/D", "X/Z/U*"})
# "U*" is internal: keep a sequence and recurse (the UID rows inside remap the references).
RECURSE_UIDS = "U*"

_COMPOUND = {"X/Z": "Z", "Z/D": "D", "X/D": "D", "X/Z/D": "D", "X/Z/U*": RECURSE_UIDS}
# When several selected options name one row, the more retaining code wins (K over C), with one
# exception: a Retain Longitudinal Modified Dates code always wins for its rows. In the 2025b table the
# calibration/installation/manufacture dates carry Retain Device Identity = K next to Modified
# Dates = C; keeping those unshifted beside shifted study dates would reveal the date shift.
_OPTION_RANK = {"K": 2, "C": 1, "X": 0}


def resolve_basic(code: str) -> str:
    """Map a Table E.1-1 basic-profile code to the one action we apply (see module doc)."""
    if code in SIMPLE_ACTIONS:
        return code
    try:
        return _COMPOUND[code]
    except KeyError:
        raise ValueError(f"unknown Table E.1-1 action code {code!r}") from None


@dataclass(frozen=True)
class ProfileRow:
    tag: str  # as printed in the table, e.g. "(0008,0050)" or "(60xx,3000)"
    name: str
    keyword: str
    basic: str
    options: dict[str, str]
    in_std_comp_iod: bool

    @property
    def mask_value(self) -> tuple[int, int] | None:
        """(mask, value) over the 32-bit tag; None for the private-attributes row."""
        text = self.tag.strip("()").replace(",", "")
        if len(text) != 8:
            return None
        mask = int("".join("0" if c == "x" else "F" for c in text), 16)
        value = int(text.replace("x", "0"), 16)
        return mask, value

    @property
    def is_pattern(self) -> bool:
        return "x" in self.tag and self.mask_value is not None


@dataclass(frozen=True)
class ProfileTable:
    edition: str
    source: dict[str, Any]
    rows: tuple[ProfileRow, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def row_for(self, tag: int) -> ProfileRow | None:
        for row in self.rows:
            mv = row.mask_value
            if mv is not None and (tag & mv[0]) == mv[1]:
                return row
        return None


@lru_cache(maxsize=1)
def load_table() -> ProfileTable:
    """Load the bundled Table E.1-1 (cached; it never changes at run time)."""
    raw = json.loads(resources.files(__package__).joinpath("profile_table.json").read_text(encoding="utf-8"))
    rows = []
    for r in raw["rows"]:
        if r["basic"] not in BASIC_CODES:
            raise ValueError(f"profile table row {r['tag']} has unknown code {r['basic']!r}")
        rows.append(
            ProfileRow(
                tag=r["tag"],
                name=r["name"],
                keyword=r["keyword"],
                basic=r["basic"],
                options=dict(r["options"]),
                in_std_comp_iod=bool(r["in_std_comp_iod"]),
            )
        )
    return ProfileTable(edition=raw["edition"], source=raw["source"], rows=tuple(rows))


@dataclass(frozen=True)
class CompiledProfile:
    """Per-tag actions for one option set: exact tags in a dict, patterns in a short list."""

    exact: dict[int, str]
    patterns: tuple[tuple[int, int, str], ...]
    private_action: str  # "X" or "C" (keep the allow-listed safe private attributes)
    options: frozenset[str] = field(default_factory=frozenset)

    def action_for(self, tag: int) -> str | None:
        action = self.exact.get(tag)
        if action is not None:
            return action
        group = tag >> 16
        if 0x5000 <= group <= 0x60FF:  # only curves/overlays have pattern rows
            for mask, value, act in self.patterns:
                if (tag & mask) == value:
                    return act
        return None


def _row_action(row: ProfileRow, options: frozenset[str]) -> str:
    modified = Option.RETAIN_LONGITUDINAL_MODIFIED_DATES.value
    if modified in options and modified in row.options:
        return row.options[modified]
    chosen: str | None = None
    for opt, code in row.options.items():
        if opt in options and (chosen is None or _OPTION_RANK[code] > _OPTION_RANK[chosen]):
            chosen = code
    if chosen is not None:
        return chosen
    return resolve_basic(row.basic)


def compile_profile(
    options: frozenset[str] | set[str] = frozenset(),
    overrides: dict[int, str] | None = None,
    table: ProfileTable | None = None,
) -> CompiledProfile:
    """Resolve the table for ``options``; ``overrides`` (tag int -> simple action) win last."""
    table = table or load_table()
    opts = frozenset(options)
    exact: dict[int, str] = {}
    patterns: list[tuple[int, int, str]] = []
    private_action = "X"
    for row in table.rows:
        action = _row_action(row, opts)
        mv = row.mask_value
        if mv is None:
            private_action = action
        elif row.is_pattern:
            patterns.append((mv[0], mv[1], action))
        else:
            exact[mv[1]] = action
    for tag, action in (overrides or {}).items():
        if action not in SIMPLE_ACTIONS:
            raise ValueError(f"override action {action!r} for {tag:08X} is not one of {sorted(SIMPLE_ACTIONS)}")
        exact[tag] = action
    return CompiledProfile(exact=exact, patterns=tuple(patterns), private_action=private_action, options=opts)

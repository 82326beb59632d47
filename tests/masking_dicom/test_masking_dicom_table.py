"""The bundled Table E.1-1: provenance, cross-checked rows, compound resolution, options, patterns."""

from __future__ import annotations

import pytest

from securetrain.masking.dicom.profile_table import (
    CID7050,
    Option,
    compile_profile,
    load_table,
    resolve_basic,
)


def test_table_provenance_and_size() -> None:
    table = load_table()
    assert len(table) >= 460
    assert table.source["repository"] == "innolitics/dicom-standard"
    assert len(table.source["commit"]) == 40
    assert "edition" in table.edition or "PS3.15" in table.edition
    tags = [r.tag for r in table.rows]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize(
    "tag,basic,options",
    [
        # cross-checked against PS3.15 (2013 edition list in KitwareMedical/dicom-anonymizer) and the standard text
        ("(0010,0010)", "Z", {}),
        ("(0010,0020)", "Z", {}),
        ("(0008,0080)", "X/Z/D", {"retain_institution_identity": "K"}),
        ("(0070,0001)", "D", {"clean_graphics": "C"}),
        ("(0008,1140)", "X/Z/U*", {"retain_uids": "K"}),
        ("(0008,0018)", "U", {"retain_uids": "K"}),
        ("(0008,0020)", "Z", {"retain_longitudinal_full_dates": "K", "retain_longitudinal_modified_dates": "C"}),
        ("(0010,1010)", "X", {"retain_patient_characteristics": "K"}),
        ("(0018,1000)", "X/Z/D", {"retain_device_identity": "K"}),
        ("(0008,103E)", "X", {"clean_descriptors": "C"}),
        ("(0040,A730)", "D", {"clean_structured_content": "C"}),
        ("(0008,1120)", "X", {"retain_uids": "X"}),
        ("(60xx,3000)", "X", {"clean_graphics": "C"}),
        ("(50xx,xxxx)", "X", {"clean_graphics": "C"}),
        ("(0008,010D)", "U", {"retain_uids": "K"}),  # supplemented from the 2013 edition
    ],
)
def test_cross_checked_rows(tag: str, basic: str, options: dict[str, str]) -> None:
    row = next(r for r in load_table().rows if r.tag == tag)
    assert row.basic == basic
    assert row.options == options


def test_private_row() -> None:
    row = next(r for r in load_table().rows if r.mask_value is None)
    assert row.basic == "X" and row.options == {"retain_safe_private": "C"}


@pytest.mark.parametrize(
    "code,action", [("X", "X"), ("Z", "Z"), ("D", "D"), ("U", "U"), ("X/Z", "Z"), ("Z/D", "D"),
                    ("X/D", "D"), ("X/Z/D", "D"), ("X/Z/U*", "U*")]
)
def test_compound_resolution(code: str, action: str) -> None:
    assert resolve_basic(code) == action


def test_unknown_code_rejected() -> None:
    with pytest.raises(ValueError):
        resolve_basic("Q")


def test_compile_options_and_overrides() -> None:
    base = compile_profile()
    assert base.action_for(0x00100010) == "Z"
    assert base.action_for(0x00080018) == "U"
    assert base.action_for(0x00080020) == "Z"
    assert base.action_for(0x00080080) == "D"
    assert base.action_for(0x00180015) is None  # Body Part Examined: not listed -> kept
    assert base.private_action == "X"
    assert base.action_for(0x60023000) == "X" and base.action_for(0x601E4000) == "X"
    assert base.action_for(0x50101234) == "X"
    assert base.action_for(0x60020010) is None  # Overlay Rows is not a row (the engine drops the group)
    opts = compile_profile({Option.RETAIN_UIDS.value, Option.RETAIN_LONGITUDINAL_MODIFIED_DATES.value,
                            Option.RETAIN_SAFE_PRIVATE.value, Option.CLEAN_GRAPHICS.value})
    assert opts.action_for(0x00080018) == "K"
    assert opts.action_for(0x00080020) == "C"
    assert opts.action_for(0x00081120) == "X"
    assert opts.private_action == "C"
    assert opts.action_for(0x60003000) == "C"
    full = compile_profile({Option.RETAIN_LONGITUDINAL_FULL_DATES.value})
    assert full.action_for(0x00080020) == "K"
    over = compile_profile(overrides={0x00100010: "K", 0x00181030: "X"})
    assert over.action_for(0x00100010) == "K" and over.action_for(0x00181030) == "X"
    with pytest.raises(ValueError):
        compile_profile(overrides={0x00100010: "X/Z"})


def test_cid7050_codes() -> None:
    assert CID7050["basic"][0] == "113100"
    assert {code for code, _ in CID7050.values()} == {f"1131{n:02d}" for n in range(0, 13)} - {"113102"}
    assert set(CID7050) - {"basic"} == {o.value for o in Option}

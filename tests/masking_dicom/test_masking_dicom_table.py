"""The bundled Table E.1-1: provenance, cross-checked rows, compound resolution, options, patterns."""

from __future__ import annotations

import json
from importlib import resources

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
    # 657 rows of the 2026d edition + 3 PS3.15-2013 rows the newer editions no longer list
    assert len(table) == 660
    assert table.edition == "DICOM PS3.15 2026d"
    assert table.source["repository"] == "pymedphys/pymedphys"
    assert table.source["rows"] == 657
    assert len(table.source["commit"]) == 40
    tags = [r.tag for r in table.rows]
    assert len(tags) == len(set(tags))
    columns = {o.value for o in Option} - {Option.CLEAN_PIXEL_DATA.value}
    assert all(set(r.options) <= columns and set(r.options.values()) <= {"K", "C"} for r in table.rows)


def test_supplement_rows_are_marked() -> None:
    raw = json.loads(resources.files("securetrain.masking.dicom").joinpath("profile_table.json").read_text("utf-8"))
    marked = {r["tag"] for r in raw["rows"] if "source" in r}
    assert marked == set(raw["supplement"]["rows"]) == {"(0008,010D)", "(0008,9123)", "(0020,3404)"}


@pytest.mark.parametrize(
    "tag,basic,options",
    [
        # cross-checked against PS3.15 (2013 edition list in KitwareMedical/dicom-anonymizer), the standard text
        # and, for 2025b, sjoerdk/idiscore's scrape of the NEMA table (2025-06-24)
        ("(0010,0010)", "Z", {}),
        ("(0010,0020)", "Z/D", {}),  # was Z up to the 2020-2021 editions
        ("(0008,0080)", "X/Z/D", {"retain_institution_identity": "K"}),
        ("(0070,0001)", "D", {"clean_graphics": "C"}),
        ("(0008,1140)", "X/Z/U*", {"retain_uids": "K"}),
        ("(0008,0018)", "U", {"retain_uids": "K"}),
        ("(0008,0020)", "Z", {"retain_longitudinal_full_dates": "K", "retain_longitudinal_modified_dates": "C"}),
        ("(0010,1010)", "X", {"retain_patient_characteristics": "K"}),
        ("(0018,1000)", "X/Z/D", {"retain_device_identity": "K"}),
        ("(0008,103E)", "X", {"clean_descriptors": "C"}),
        ("(0040,A730)", "D", {"clean_structured_content": "C"}),
        ("(0008,1120)", "X", {"retain_uids": "K"}),  # Retain UIDs was X in the 2020-2021 editions
        ("(60xx,3000)", "X", {"clean_graphics": "C"}),
        ("(50xx,xxxx)", "X", {"clean_graphics": "C"}),
        ("(0008,010D)", "U", {"retain_uids": "K"}),  # supplemented from the 2013 edition
        # rows new since the 2020-2021 table
        ("(0008,0017)", "U", {"retain_uids": "K"}),
        ("(0010,0043)", "X", {"retain_patient_characteristics": "K"}),
        ("(0018,1200)", "X", {"retain_device_identity": "K", "retain_longitudinal_full_dates": "K",
                              "retain_longitudinal_modified_dates": "C"}),
        ("(0040,A123)", "D", {}),
        ("(006A,0003)", "D", {"retain_uids": "K"}),
        # rows new in 2026d (checked against a second, independent 2026d pin)
        ("(0040,E012)", "X", {}),  # Display URI: carried a PatientID in a real file
        ("(003A,0020)", "X", {"clean_descriptors": "C"}),  # Multiplex Group Label (waveforms)
        ("(003A,0203)", "X", {"clean_descriptors": "C"}),  # Channel Label
        ("(0040,B020)", "X/D", {"clean_structured_content": "C"}),  # Waveform Annotation Sequence
        ("(0070,0006)", "D", {"clean_descriptors": "C"}),  # Unformatted Text Value
        ("(0018,1010)", "X", {"retain_device_identity": "K"}),
        ("(0032,1033)", "X", {"clean_descriptors": "C"}),  # Requesting Service gained the option in 2026d
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
    assert opts.action_for(0x00081120) == "K"  # Referenced Patient Sequence: Retain UIDs = K since 2021+
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


def test_modified_dates_code_wins_over_device_identity_keep() -> None:
    # Date of Last Calibration: Retain Device Identity = K, Modified Dates = C. Keeping it unshifted next to
    # shifted study dates would reveal the shift, so C wins; alone, Retain Device Identity keeps it.
    dev = Option.RETAIN_DEVICE_IDENTITY.value
    both = compile_profile({dev, Option.RETAIN_LONGITUDINAL_MODIFIED_DATES.value})
    assert both.action_for(0x00181200) == "C" and both.action_for(0x00181201) == "C"
    assert both.action_for(0x00181000) == "K"  # Device Serial Number: only the device option names it
    assert compile_profile({dev}).action_for(0x00181200) == "K"
    assert compile_profile().action_for(0x00181200) == "X"
    # two K codes (Retain UIDs and Retain Device Identity on Device UID) still keep
    assert compile_profile({dev, Option.RETAIN_UIDS.value}).action_for(0x00181002) == "K"


def _run_update_script(args: list[str]) -> tuple[int, str]:
    import contextlib
    import importlib.util
    import io
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "update_profile_table.py"
    spec = importlib.util.spec_from_file_location("update_profile_table", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = module.main(args)
    return rc, out.getvalue()


def test_update_script_prints_row_and_cell_diff_and_regenerates(tmp_path) -> None:
    """The maintainer script reads an extraction (innolitics layout here), prints added/removed rows and
    changed option cells, and only with --write regenerates a table that loads and compiles."""
    table = tmp_path / "profile_table.json"
    bundled = resources.files("securetrain.masking.dicom").joinpath("profile_table.json").read_text("utf-8")
    table.write_text(bundled, encoding="utf-8")
    raw = json.loads(bundled)
    source = []
    for r in raw["rows"]:
        if "source" in r or r["tag"] == "(0040,E012)":  # drop a row: shows as removed
            continue
        item = {"name": r["name"], "tag": r["tag"], "stdCompIOD": "Y" if r["in_std_comp_iod"] else "N",
                "basicProfile": r["basic"]}
        names = {"retain_uids": "rtnUIDsOpt", "clean_descriptors": "cleanDescOpt"}
        for opt, code in r["options"].items():
            item[{"retain_safe_private": "rtnSafePrivOpt", "retain_device_identity": "rtnDevIdOpt",
                  "retain_institution_identity": "rtnInstIdOpt", "retain_patient_characteristics": "rtnPatCharsOpt",
                  "retain_longitudinal_full_dates": "rtnLongFullDatesOpt",
                  "retain_longitudinal_modified_dates": "rtnLongModifDatesOpt",
                  "clean_structured_content": "cleanStructContOpt", "clean_graphics": "cleanGraphOpt",
                  **names}[opt]] = code
        if r["tag"] == "(0008,103E)":
            item.pop("cleanDescOpt")  # an option cell disappears
        source.append(item)
    source.append({"name": "Invented Test Attribute", "tag": "(0099,0010)", "stdCompIOD": "N", "basicProfile": "X"})
    src = tmp_path / "confidentiality_profile_attributes.json"
    src.write_text(json.dumps(source), encoding="utf-8")
    args = [str(src), "--edition", "2099z", "--repository", "example/extraction", "--path", "x.json",
            "--commit", "0" * 40, "--table", str(table)]
    rc, out = _run_update_script(args)
    assert rc == 0
    assert "+ (0099,0010) Invented Test Attribute: X" in out
    assert "- (0040,E012) Display URI" in out
    assert "~ (0008,103E) Series Description: clean_descriptors C -> -" in out
    assert table.read_text("utf-8") == bundled  # dry run by default
    rc, out = _run_update_script([*args, "--write"])
    new = json.loads(table.read_text("utf-8"))
    assert new["edition"] == "DICOM PS3.15 2099z" and new["source"]["commit"] == "0" * 40
    tags = {r["tag"] for r in new["rows"]}
    assert "(0099,0010)" in tags and "(0040,E012)" not in tags
    assert {"(0008,010D)", "(0008,9123)", "(0020,3404)"} <= tags  # older-edition rows kept
    from securetrain.masking.dicom.profile_table import ProfileRow, ProfileTable

    regenerated = ProfileTable(new["edition"], new["source"], tuple(
        ProfileRow(r["tag"], r["name"], r["keyword"], r["basic"], r["options"], r["in_std_comp_iod"])
        for r in new["rows"]))
    assert compile_profile(table=regenerated).action_for(0x00990010) == "X"


def test_update_script_reads_the_docbook_part15(tmp_path) -> None:
    """The standard's own DocBook source: Table E.1-1 by label, columns by header text, edition
    from the subtitle; every cell validated."""
    header = ["Attribute Name", "Tag", "Retd.", "In Std. Comp. IOD", "Basic Prof.", "Rtn. Safe Priv. Opt.",
              "Rtn. UIDs Opt.", "Rtn. Dev. Id. Opt.", "Rtn. Inst. Id. Opt.", "Rtn. Pat. Chars. Opt.",
              "Rtn. Long. Full Dates Opt.", "Rtn. Long. Modif. Dates Opt.", "Clean Desc. Opt.",
              "Clean Struct. Cont. Opt.", "Clean Graph. Opt."]

    def row(cells: list[str]) -> str:
        return "<tr>" + "".join(f"<td><para>{c}</para></td>" for c in cells) + "</tr>"

    body = [
        ["Accession Number", "(0008,0050)", "N", "Y", "Z", "", "", "", "", "", "", "", "", "", ""],
        ["Study Date", "(0008,0020)", "N", "Y", "Z", "", "", "", "", "", "K", "C", "", "", ""],
        ["Curve Data", "(50xx,xxxx)", "Y", "N", "X", "", "", "", "", "", "", "", "", "", "C"],
        ["Private Attributes", "(gggg,eeee) where gggg is odd", "N", "N", "X", "C", "", "", "", "", "", "", "", "", ""],
    ]
    xml = ('<book xmlns="http://docbook.org/ns/docbook"><info><subtitle>DICOM PS3.15 2099a - Security'
           '</subtitle></info><table label="E.1-1"><thead><tr>'
           + "".join(f"<th><para>{h}</para></th>" for h in header) + "</tr></thead><tbody>"
           + "".join(row(r) for r in body) + "</tbody></table></book>")
    src = tmp_path / "part15.xml"
    src.write_text(xml, encoding="utf-8")
    table = tmp_path / "profile_table.json"
    table.write_text(resources.files("securetrain.masking.dicom").joinpath("profile_table.json").read_text("utf-8"))
    rc, out = _run_update_script([str(src), "--repository", "example/part15", "--path", "part15.xml",
                                  "--commit", "1" * 40, "--table", str(table), "--write"])
    assert rc == 0 and "-> DICOM PS3.15 2099a (4 rows" in out
    new = {r["tag"]: r for r in json.loads(table.read_text("utf-8"))["rows"]}
    assert new["(0008,0020)"]["options"] == {"retain_longitudinal_full_dates": "K",
                                              "retain_longitudinal_modified_dates": "C"}
    assert new["(50xx,xxxx)"]["options"] == {"clean_graphics": "C"}
    assert new["(gggg,eeee) where gggg is odd"]["options"] == {"retain_safe_private": "C"}
    bad = tmp_path / "bad.xml"
    bad.write_text(xml.replace("<td><para>Z</para></td>", "<td><para>Q</para></td>", 1), encoding="utf-8")
    with pytest.raises(SystemExit, match="unknown basic-profile code"):
        _run_update_script([str(bad), "--repository", "e/p", "--path", "p", "--commit", "1" * 40,
                            "--table", str(table)])

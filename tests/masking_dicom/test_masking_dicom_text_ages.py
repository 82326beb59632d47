"""Ages over 89 written into free text the profile keeps (a description cleaned under Clean
Descriptors, a text value of a cleaned SR tree): under ``age_over_89: aggregate`` they become the
one category ("92 year old" -> "90+ year old", "Age: 091Y" -> "Age: 090Y"), like Patient's Age;
numbers that are not ages ("92 slices", "series 95") stay (docs/dicom-deid.md, "Ages over 89")."""

from __future__ import annotations

import json

import pytest
from dicom_fixtures import POLICY_DIR, SECRET, make_dataset, roundtrip
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence

from securetrain.masking.dicom.ages import aggregate_text_ages
from securetrain.masking.dicom.engine import Deidentifier
from securetrain.masking.dicom.policy import load_policy

LONGITUDINAL = POLICY_DIR / "dicom-research-longitudinal.yaml"


def _deid(**update: object) -> Deidentifier:
    data = load_policy(LONGITUDINAL).model_dump(mode="json")
    return Deidentifier(load_policy(data={**data, **update}), SECRET)


@pytest.mark.parametrize(("text", "expected"), [
    ("92 year old female", "90+ year old female"),
    ("92yo F", "90+yo F"),
    ("age 95", "age 90+"),
    ("95-year-old man", "90+-year-old man"),
    ("Age: 091Y", "Age: 090Y"),
    ("aged 104, fall", "aged 90+, fall"),
    ("CT HEAD 093Y F", "CT HEAD 090Y F"),
    ("92 y/o male", "90+ y/o male"),
    ("pt 92 y.o.", "pt 90+ y.o."),
    ("101 yrs", "90+ yrs"),
    ("AGE:1100M", "AGE:090Y"),  # 91.7 years, in months
    ("age 92.5", "age 90+"),
    ("92 years of age", "90+ years of age"),
    ("Ages 93 and 97 years", "Ages 90+ and 90+ years"),
    ("age 90", "age 90+"),
])
def test_ages_over_89_in_text_are_aggregated(text: str, expected: str) -> None:
    new, count = aggregate_text_ages(text)
    assert new == expected
    assert count == expected.count("90+") + expected.count("090Y")


@pytest.mark.parametrize("text", [
    "92 slices", "series 95", "AXIAL 95 kV 120 mAs", "Image 95", "page 95", "dosage 95", "age-matched 95 controls",
    "age 45", "45 year old", "Age: 089Y", "1079M", "AGE 1079M", "1992 year", "slice 92 y", "series 095",
    "5mm 100", "Age: 090Y", "age 90+", "90+ year old", "0.92 years", "Phase 2 92y3", "T1 95 W",
])
def test_numbers_that_are_not_ages_over_89_are_kept(text: str) -> None:
    assert aggregate_text_ages(text) == (text, 0)


def test_a_value_at_its_maximum_length_keeps_it() -> None:
    """"90+" is one character longer than "92": a value that would no longer fit its VR gets "90"."""
    text = "x" * 58 + " 92 yo"  # 64 characters: LO's maximum
    assert aggregate_text_ages(text, max_len=64) == ("x" * 58 + " 90 yo", 1)
    assert aggregate_text_ages(text) == ("x" * 58 + " 90+ yo", 1)


def _with_text() -> Dataset:
    ds = make_dataset()
    ds.StudyDescription = "CT chest, 92 year old female"
    ds.SeriesDescription = "AXIAL 92 slices age 95"
    ds.ImageComments = "Age: 091Y, series 95"
    ds.ProtocolName = "HEAD 120 kV"
    text = Dataset()
    text.RelationshipType, text.ValueType, text.TextValue = "CONTAINS", "TEXT", "Findings: 97yo, stable"
    ds.ContentSequence = Sequence([text])  # kept and cleaned under clean_structured_content
    return roundtrip(ds)


def test_the_engine_aggregates_ages_in_retained_text_and_reports_it() -> None:
    out, report = _deid().deidentify_dataset(_with_text())
    back = roundtrip(out)
    assert back.StudyDescription == "CT chest, 90+ year old female"
    assert back.SeriesDescription == "AXIAL 92 slices age 90+"
    assert back.ImageComments == "Age: 090Y, series 95"
    assert back.ProtocolName == "HEAD 120 kV"
    assert back.ContentSequence[0].TextValue == "Findings: 90+yo, stable"  # at any depth
    aged = {(c.path, c.action) for c in report.changes if c.detail == "age_over_89"}
    assert aged == {("(0008,1030)", "C"), ("(0008,103E)", "C"), ("(0020,4000)", "C"),
                    ("(0040,A730)[0].(0040,A160)", "C")}
    document = json.dumps(report.to_dict())
    assert '"detail": "age_over_89"' in document
    for phi in ("92 year", "091Y", "97yo", "age 95"):  # the report names elements, never their values
        assert phi not in document


def test_keep_leaves_text_ages_alone_and_scrub_off_still_aggregates() -> None:
    out, report = _deid(age_over_89="keep").deidentify_dataset(_with_text())
    assert roundtrip(out).StudyDescription == "CT chest, 92 year old female"
    assert not any(c.detail == "age_over_89" for c in report.changes)
    out, _ = _deid(scrub_retained_text=False).deidentify_dataset(_with_text())
    assert roundtrip(out).StudyDescription == "CT chest, 90+ year old female"


def test_removed_text_is_not_reported_as_aggregated() -> None:
    """The basic profile removes descriptions: nothing is kept, nothing to aggregate."""
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), SECRET)
    out, report = deid.deidentify_dataset(_with_text())
    assert "StudyDescription" not in out and not any(c.detail == "age_over_89" for c in report.changes)

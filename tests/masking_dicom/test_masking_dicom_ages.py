"""HIPAA Safe Harbor ages (policy ``age_over_89``): every retained Age String above 89 years, in any
unit and at any depth, is written as the one category ``090Y``; a retained AS value that is not an
age is emptied, never kept unchecked (docs/dicom-deid.md, "Ages over 89")."""

from __future__ import annotations

import pytest
from dicom_fixtures import POLICY_DIR, SECRET, make_dataset, roundtrip
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence

from securetrain.errors import ConfigError
from securetrain.masking.dicom.ages import aggregate_age
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.policy import load_policy

LONGITUDINAL = POLICY_DIR / "dicom-research-longitudinal.yaml"


def _deid(**update: object) -> Deidentifier:
    data = load_policy(LONGITUDINAL).model_dump(mode="json")
    return Deidentifier(load_policy(data={**data, **update}), SECRET)


def _age_out(age: str, **update: object) -> Dataset:
    ds = make_dataset()
    ds.PatientAge = age
    out, _ = _deid(**update).deidentify_dataset(roundtrip(ds))
    return roundtrip(out)


@pytest.mark.parametrize(
    "age,expected",
    [
        ("057Y", "057Y"),
        ("089Y", "089Y"),
        ("090Y", "090Y"),
        ("104Y", "090Y"),
        ("1100M", "090Y"),  # 91.7 years (not a conformant AS: real devices write such values)
        ("1079M", "089Y"),  # 89.9 years
        ("5000W", "090Y"),  # 95.8 years
        ("40000D", "090Y"),  # 109.5 years
        ("32871D", "090Y"),  # the fewest days 90 years have: capped a day early, never late
        ("032D", "032D"),
        ("45y", "045Y"),  # lenient reading, conformant output
        ("20000D", "657M"),  # 54.8 years: moved to a unit whose count fits three digits
    ],
)
def test_retained_patient_age_over_89_is_aggregated(age: str, expected: str) -> None:
    out = _age_out(age)
    assert out.PatientAge == expected
    assert b"\x10\x00\x10\x10" in encode_dataset(out)  # (0010,1010) still written


def test_policy_default_is_aggregate_and_keep_opts_out() -> None:
    assert load_policy(LONGITUDINAL).age_over_89 == "aggregate"
    assert load_policy(data={"policy_version": 1, "name": "t", "profile": "basic"}).age_over_89 == "aggregate"
    assert _age_out("104Y", age_over_89="keep").PatientAge == "104Y"  # PS3.15's Retain Patient Characteristics


@pytest.mark.parametrize("age", ["unknown", "93", "93 years", "Y", "-93Y"])
def test_malformed_age_is_emptied_not_kept(age: str) -> None:
    ds = make_dataset()
    ds.PatientAge = age
    out, report = _deid().deidentify_dataset(roundtrip(ds))
    back = roundtrip(out)
    assert "PatientAge" in back and back.PatientAge == ""
    assert any(c.keyword == "PatientAge" and c.action == "Z" for c in report.changes)


def test_nested_and_multivalued_age_strings_are_aggregated() -> None:
    """Selector AS Value (0072,005F, VM 1-n) is kept by Retain Patient Characteristics inside the
    hanging-protocol selector sequences: every value of it, at any depth, is capped too."""
    ds = make_dataset()
    inner = Dataset()
    inner.SelectorASValue = ["095Y", "030Y", "1200M"]
    outer = Dataset()
    outer.ReferencedImageSequence = Sequence([inner])
    ds.ContentSequence = Sequence([outer])  # kept and cleaned under clean_structured_content
    inner_top = Dataset()
    inner_top.SelectorASValue = "100Y"
    ds.ReferencedSeriesSequence = Sequence([inner_top])
    out, _ = _deid().deidentify_dataset(roundtrip(ds))
    back = roundtrip(out)
    assert list(back.ContentSequence[0].ReferencedImageSequence[0].SelectorASValue) == ["090Y", "030Y", "090Y"]
    assert back.ReferencedSeriesSequence[0].SelectorASValue == "090Y"


def test_an_age_kept_by_override_is_aggregated_too() -> None:
    data = load_policy(POLICY_DIR / "dicom-basic.yaml").model_dump(mode="json")
    deid = Deidentifier(load_policy(data={**data, "overrides": {"PatientAge": "K"}}), SECRET)
    ds = make_dataset()
    ds.PatientAge = "097Y"
    out, _ = deid.deidentify_dataset(roundtrip(ds))
    assert roundtrip(out).PatientAge == "090Y"


@pytest.mark.parametrize("action", ["K", "C"])
def test_a_retained_birth_date_is_refused_with_aggregate(action: str) -> None:
    """A kept (or shifted: the study dates move by the same offset) birth date gives the exact age
    back: with age_over_89: aggregate the policy is refused, naming the field."""
    base = {"policy_version": 1, "name": "t", "profile": "basic"}
    with pytest.raises(ConfigError) as exc:
        load_policy(data={**base, "overrides": {"PatientBirthDate": action}})
    assert "age_over_89" in str(exc.value) and "PatientBirthDate" in str(exc.value)
    assert load_policy(data={**base, "overrides": {"PatientBirthDate": action}, "age_over_89": "keep"})


def test_aggregate_age_reads_every_unit() -> None:
    assert aggregate_age("090Y") == "090Y"
    assert aggregate_age("4696W") == "090Y" and aggregate_age("4695W") == "089Y"
    assert aggregate_age("") == ""
    assert aggregate_age("abc") is None


def test_implicit_vr_and_safe_private_ages_are_aggregated() -> None:
    """An Implicit VR file's raw AS element (no VR in the stream) and an AS value Retain Safe Private
    keeps are capped like any other retained age."""
    import io

    import pydicom
    from pydicom.uid import ImplicitVRLittleEndian

    ds = make_dataset()
    ds.PatientAge = "104Y"
    ds.file_meta.TransferSyntaxUID = ImplicitVRLittleEndian
    ds.private_block(0x0029, "ACME SAFE 1.0").add_new(0x12, "AS", "095Y")
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    data = load_policy(LONGITUDINAL).model_dump(mode="json")
    deid = Deidentifier(load_policy(data={
        **data, "options": [*data["options"], "retain_safe_private"],
        "safe_private": [{"creator": "ACME SAFE 1.0", "group": "0029", "elements": ["12"]}]}), SECRET)
    out, _ = deid.deidentify_dataset(pydicom.dcmread(io.BytesIO(buf.getvalue())))
    back = pydicom.dcmread(io.BytesIO(encode_dataset(out)))
    assert back.file_meta.TransferSyntaxUID == ImplicitVRLittleEndian
    assert back.PatientAge == "090Y" and back[0x00291012].value == b"090Y"

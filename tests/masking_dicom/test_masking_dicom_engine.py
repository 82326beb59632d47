"""Engine behaviour on a hand-built PHI-laden dataset: actions, nesting, UIDs, dates, marks."""

from __future__ import annotations

import io
import re

import numpy as np
import pydicom
import pytest
from dicom_fixtures import OTHER_SECRET, POLICY_DIR, SECRET, make_dataset, roundtrip
from pydicom.dataset import Dataset

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset, is_well_known_uid
from securetrain.masking.dicom.errors import BurnedInAnnotationError
from securetrain.masking.dicom.policy import load_policy

UID_RE = re.compile(r"^2\.25\.(0|[1-9][0-9]{0,38})$")


def basic() -> Deidentifier:
    return Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), SECRET)


def research() -> Deidentifier:
    return Deidentifier(load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml"), SECRET)


def policy(**changes: object):
    data = {"policy_version": 1, "name": "t", "profile": "basic", "options": []}
    data.update(changes)
    return load_policy(data=data)


def out_bytes(deid: Deidentifier, ds: Dataset) -> tuple[Dataset, bytes]:
    deid.deidentify_dataset(ds)
    blob = encode_dataset(ds)
    return pydicom.dcmread(io.BytesIO(blob)), blob


def test_basic_profile_actions_top_level(phi_ds: Dataset) -> None:
    out, blob = out_bytes(basic(), phi_ds)
    # X: removed
    for kw in ("PatientAddress", "OtherPatientIDs", "InstitutionAddress", "ImageComments", "StudyDescription",
               "SeriesDescription", "PatientAge", "PatientWeight", "TimezoneOffsetFromUTC"):
        assert kw not in out, kw
    # Z: present, empty
    for kw in ("AccessionNumber", "StudyID", "ReferringPhysicianName", "PatientBirthDate", "StudyDate", "StudyTime", "PatientSex"):
        assert kw in out and (out[kw].value in (None, "", b"")), kw
    # X/Z/D, X/D, Z/D -> D: fixed dummy
    assert out.InstitutionName == "ANONYMIZED"
    assert out.StationName == "ANONYMIZED"
    assert out.DeviceSerialNumber == "ANONYMIZED"
    assert str(out.OperatorsName) == "ANONYMOUS"
    assert out.SeriesDate == "19000101" and out.ContentDate == "19000101"
    assert out.InstanceCreationDate == "19000101"  # X/D in the 2025b table
    # Date not listed in the table: safety net empties it
    assert out.ExpiryDate in (None, "")
    # kept
    assert out.Modality == "CT" and out.Manufacturer == "ACME Imaging" and out.BodyPartExamined == "CHEST"
    assert b"QUIRINIUS" not in blob.upper() and b"BARTHOLOMEW" not in blob.upper()


def test_pseudonyms_and_uid_remap_are_keyed_and_deterministic(phi_ds: Dataset) -> None:
    a1, _ = out_bytes(basic(), roundtrip(make_dataset()))
    a2, _ = out_bytes(basic(), roundtrip(make_dataset()))  # a new run, same key
    b, _ = out_bytes(Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), OTHER_SECRET), roundtrip(make_dataset()))
    assert a1.PatientID == a2.PatientID and a1.PatientID != "PID-7734-QQ" and a1.PatientID.startswith("ST")
    assert str(a1.PatientName).startswith(a1.PatientID)
    for kw in ("SOPInstanceUID", "StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID"):
        assert a1[kw].value == a2[kw].value, kw
        assert a1[kw].value != b[kw].value, kw
        assert UID_RE.match(a1[kw].value) and len(a1[kw].value) <= 64
    assert a1.PatientID != b.PatientID
    # file meta follows, well-known UIDs kept
    assert a1.file_meta.MediaStorageSOPInstanceUID == a1.SOPInstanceUID
    assert a1.SOPClassUID == "1.2.840.10008.5.1.4.1.1.2"
    assert a1.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.1"
    assert "SourceApplicationEntityTitle" not in a1.file_meta


def test_references_in_nested_sequences_follow_the_remap(phi_ds: Dataset) -> None:
    deid = basic()
    ref_target = roundtrip(make_dataset(sop_uid="1.3.6.1.4.1.99999.1.2.3.4.200"))
    target_out, _ = out_bytes(deid, ref_target)
    out, blob = out_bytes(deid, phi_ds)
    # X/Z/U*: the sequence stays and its Referenced SOP Instance UID equals the remapped target
    assert out.ReferencedImageSequence[0].ReferencedSOPInstanceUID == target_out.SOPInstanceUID
    assert out.SourceImageSequence[0].ReferencedSOPInstanceUID == target_out.SOPInstanceUID
    assert "DerivationDescription" not in out.SourceImageSequence[0]
    # three levels down in an unlisted sequence
    deep = out.ReferencedInstanceSequence[0].ReferencedSeriesSequence[0].ReferencedInstanceSequence[0]
    assert deep.ReferencedSOPInstanceUID == out.SOPInstanceUID
    assert out.ReferencedInstanceSequence[0].ReferencedSeriesSequence[0].SeriesInstanceUID == out.SeriesInstanceUID
    assert str(deep.PersonName) == "ANONYMOUS"  # Person Name (0040,A123) is D
    assert b"OSWALDINE" not in blob
    # Referenced Study Sequence is X/Z -> Z: present, empty
    assert len(out.ReferencedStudySequence) == 0
    # Content Sequence is D in the basic profile -> emptied (no dummy item can be made)
    assert len(out.ContentSequence) == 0
    assert b"FENWICK" not in blob and b"Findings" not in blob
    # Request Attributes Sequence is X
    assert "RequestAttributesSequence" not in out


def test_structured_content_is_cleaned_recursively_with_option(phi_ds: Dataset) -> None:
    out, blob = out_bytes(research(), phi_ds)
    text = out.ContentSequence[0]
    assert text.ValueType == "TEXT"
    assert "Quirinius" not in text.TextValue and text.TextValue.endswith(": normal")
    assert str(text.ContentSequence[0].PersonName) == "ANONYMOUS"
    assert b"FENWICK" not in blob


def test_private_tags_removed_and_overlays_curves_dropped(phi_ds: Dataset) -> None:
    out, blob = out_bytes(basic(), phi_ds)
    assert not [e for e in out.iterall() if e.tag.is_private]
    assert not [e for e in out if e.tag.group in (0x5000, 0x6000)]
    assert b"PRIV-MRN" not in blob and b"NESTED-PRIV-ID" not in blob and b"ACME SAFE" not in blob


def test_retain_safe_private_keeps_only_allow_listed_with_creator(phi_ds: Dataset) -> None:
    pol = policy(options=["retain_safe_private"],
                 safe_private=[{"creator": "ACME SAFE 1.0", "group": "0029", "elements": ["10"]}])
    out, blob = out_bytes(Deidentifier(pol, SECRET), phi_ds)
    block = out.private_block(0x0029, "ACME SAFE 1.0")
    assert float(block[0x10].value) == 2.5
    assert 0x00291011 not in out and 0x00291111 not in out
    assert not [e for e in out if e.tag.group == 0x0033]
    assert b"PRIVATE-PHI" not in blob
    codes = {i.CodeValue for i in out.DeidentificationMethodCodeSequence}
    assert codes == {"113100", "113111"}


def test_deidentification_marks(phi_ds: Dataset) -> None:
    out, _ = out_bytes(basic(), phi_ds)
    assert out.PatientIdentityRemoved == "YES"
    assert any("Basic Application Confidentiality Profile" in v for v in out.DeidentificationMethod)
    assert [i.CodeValue for i in out.DeidentificationMethodCodeSequence] == ["113100"]
    assert all(i.CodingSchemeDesignator == "DCM" for i in out.DeidentificationMethodCodeSequence)
    assert out.LongitudinalTemporalInformationModified == "REMOVED"
    out2, _ = out_bytes(research(), roundtrip(make_dataset()))
    assert out2.LongitudinalTemporalInformationModified == "MODIFIED"
    assert {i.CodeValue for i in out2.DeidentificationMethodCodeSequence} == {
        "113100", "113107", "113108", "113109", "113105", "113104", "113103"}
    full = Deidentifier(policy(options=["retain_longitudinal_full_dates"]), SECRET)
    out3, _ = out_bytes(full, roundtrip(make_dataset()))
    assert out3.LongitudinalTemporalInformationModified == "UNMODIFIED"
    assert out3.StudyDate == "20190314" and out3.InstanceCreationDate == "20190314"
    assert out3.ExpiryDate == "20190314"


def test_modified_dates_shift_consistently_per_patient() -> None:
    deid = research()
    a, _ = out_bytes(deid, roundtrip(make_dataset(study_date="20190314")))
    a_later, _ = out_bytes(deid, roundtrip(make_dataset(study_date="20190324", sop_uid="1.2.3.999.1")))
    import datetime as dt

    def d(s: str) -> dt.date:
        return dt.datetime.strptime(s, "%Y%m%d").date()

    assert a.StudyDate != "20190314"
    # the interval between two studies of one patient is exact
    assert (d(a_later.StudyDate) - d(a.StudyDate)).days == 10
    shift = (d(a.StudyDate) - d("20190314")).days
    assert 1 <= abs(shift) <= 3650
    assert a.PatientBirthDate in (None, "")  # Z in the table, no option column: stays empty
    # DT shifted by the same days, time kept, UTC offset dropped; TM unchanged
    assert a.AcquisitionDateTime[8:] == "101533.000000"
    assert (d(a.AcquisitionDateTime[:8]) - d("20190314")).days == shift
    assert a.StudyTime == "101530.250"
    assert a.InstanceCreationDate == a.StudyDate
    assert a.ExpiryDate == a.StudyDate  # unlisted DA follows the same rule
    # another patient gets (almost surely) another offset; the same patient in a new run the same
    b, _ = out_bytes(deid, roundtrip(make_dataset(patient_id="OTHER-PATIENT-1", study_date="20190314")))
    again, _ = out_bytes(research(), roundtrip(make_dataset(study_date="20190314")))
    assert again.StudyDate == a.StudyDate
    assert b.StudyDate != a.StudyDate
    # research policy retains patient characteristics and device identity
    assert a.PatientAge == "057Y" and a.PatientSex == "F" and a.StationName == "CTSTATION-QX9"


def test_retained_text_is_scrubbed_of_removed_values(phi_ds: Dataset) -> None:
    out, blob = out_bytes(research(), phi_ds)  # clean_descriptors keeps the descriptions
    assert "QUIRINIUS" not in out.SeriesDescription.upper()
    assert out.SeriesDescription.startswith("AXIAL ") and out.SeriesDescription.endswith(" 5mm")
    assert "Quirinius" not in out.StudyDescription
    assert b"QUIRINIUS" not in blob.upper()


def test_pixels_unchanged_and_output_valid(phi_ds: Dataset) -> None:
    before = phi_ds.pixel_array.copy()
    out, _ = out_bytes(basic(), phi_ds)
    assert np.array_equal(out.pixel_array, before)


def test_overrides_win(phi_ds: Dataset) -> None:
    pol = policy(overrides={"(0008,1030)": "K", "Manufacturer": "X", "PatientID": "Z"})
    out, _ = out_bytes(Deidentifier(pol, SECRET), phi_ds)
    assert "Manufacturer" not in out
    assert out.PatientID in (None, "")
    # kept by override but still scrubbed of the patient's name
    assert out.StudyDescription.startswith("CT chest for") and "Quirinius" not in out.StudyDescription


def test_retain_uids_keeps_instance_uids(phi_ds: Dataset) -> None:
    out, _ = out_bytes(Deidentifier(policy(options=["retain_uids"]), SECRET), phi_ds)
    assert out.SOPInstanceUID == "1.3.6.1.4.1.99999.1.2.3.4.100"
    assert out.file_meta.MediaStorageSOPInstanceUID == out.SOPInstanceUID
    assert "ReferencedPatientSequence" not in out  # the option column says X for it


@pytest.mark.parametrize("modality,flag", [("US", None), ("SC", None), ("CT", "YES"), ("CT", "MAYBE")])
def test_burned_in_rejected(modality: str, flag: str | None) -> None:
    ds = make_dataset(modality=modality)
    if flag is None:
        del ds.BurnedInAnnotation
    else:
        ds.BurnedInAnnotation = flag
    with pytest.raises(BurnedInAnnotationError):
        basic().deidentify_dataset(roundtrip(ds))


def test_burned_in_masked_per_policy() -> None:
    pol = policy(options=["clean_pixel_data"], burned_in_annotation="mask",
                 pixel_masks=[{"modality": "US", "rows": 8, "columns": 8, "rects": [[0, 0, 8, 2]]}])
    deid = Deidentifier(pol, SECRET)
    ds = make_dataset(modality="US")
    del ds.BurnedInAnnotation
    ds = roundtrip(ds)
    before = ds.pixel_array.copy()
    out, _ = out_bytes(deid, ds)
    after = out.pixel_array
    assert (after[:2] == 0).all() and np.array_equal(after[2:], before[2:])
    assert out.BurnedInAnnotation == "NO"
    assert "113101" in {i.CodeValue for i in out.DeidentificationMethodCodeSequence}
    # a size that no mask matches is rejected, never passed through
    other = make_dataset(modality="US")
    del other.BurnedInAnnotation
    other.Rows = other.Columns = 4
    other.PixelData = np.zeros((4, 4), dtype=np.uint16).tobytes()
    with pytest.raises(BurnedInAnnotationError):
        deid.deidentify_dataset(roundtrip(other))


def test_audit_records_policy_without_secrets(phi_ds: Dataset) -> None:
    audit = MemoryAuditRecorder()
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), SECRET, audit=audit)
    ev = [e for e in audit.events if e["action"] == "deid.policy_applied"]
    assert len(ev) == 1
    det = ev[0]["details"]
    assert det["policy_name"] == "dicom-basic" and len(det["policy_digest"]) == 64
    assert SECRET.hex() not in repr(audit.events) and "PID-7734" not in repr(audit.events)
    assert det["key_id"] == deid.keys.key_id


def test_report_has_no_values(phi_ds: Dataset) -> None:
    _, report = basic().deidentify_dataset(phi_ds)
    text = repr(report.to_dict())
    for secret_value in ("QUIRINIUS", "PID-7734", "20190314", "Wisteria", "1.3.6.1.4.1.99999"):
        assert secret_value not in text
    assert report.tags_changed > 30
    paths = {c["path"] for c in report.to_dict()["changes"]}
    assert "(0008,1140)[0].(0008,1155)" in paths


def test_well_known_uid_detection() -> None:
    assert is_well_known_uid("1.2.840.10008.5.1.4.1.1.2")
    assert not is_well_known_uid("1.3.6.1.4.1.99999.1")


def test_implicit_vr_private_text_is_scrubbed_from_retained_text() -> None:
    from pydicom.uid import ImplicitVRLittleEndian

    ds = make_dataset()
    ds.file_meta.TransferSyntaxUID = ImplicitVRLittleEndian
    ds.SeriesDescription = "AXIAL for PRIV-MRN-7781234"
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    implicit = pydicom.dcmread(io.BytesIO(buf.getvalue()))
    out, blob = out_bytes(research(), implicit)
    assert "PRIV-MRN" not in out.SeriesDescription and b"PRIV-MRN" not in blob
    assert not [e for e in out.iterall() if e.tag.is_private]


def test_deidentify_file_atomic_audited_and_failures(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from securetrain.masking.dicom.errors import UnreadableDicomError

    src = tmp_path / "in.dcm"
    src.write_bytes(encode_dataset(make_dataset()))
    audit = MemoryAuditRecorder()
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), SECRET, audit=audit)
    dst = tmp_path / "out" / "o.dcm"
    report = deid.deidentify_file(src, dst)
    assert report.output == str(dst) and pydicom.dcmread(dst).PatientIdentityRemoved == "YES"
    read = [e for e in audit.events if e["action"] == "dicom.read"]
    assert len(read) == 1 and len(read[0]["details"]["sha256"]) == 64
    assert deid.deidentify_file(src, tmp_path / "dry.dcm", dry_run=True).tags_changed > 0
    assert not (tmp_path / "dry.dcm").exists()
    (tmp_path / "junk.dcm").write_bytes(b"\x00" * 200)
    (tmp_path / "trunc.dcm").write_bytes(src.read_bytes()[:500])
    for bad in ("junk.dcm", "trunc.dcm", "absent.dcm"):
        with pytest.raises(UnreadableDicomError):
            deid.deidentify_file(tmp_path / bad, tmp_path / "out" / bad)
        assert not (tmp_path / "out" / bad).exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["o.dcm"]  # no temp files left


def test_clean_pixel_data_on_compressed_rle_input() -> None:
    from pydicom.data import get_testdata_file

    path = get_testdata_file("SC_rgb_rle.dcm")
    original = pydicom.dcmread(path)
    before = original.pixel_array.copy()
    rows, cols = int(original.Rows), int(original.Columns)
    pol = policy(options=["clean_pixel_data"], burned_in_annotation="mask",
                 pixel_masks=[{"modality": str(original.Modality), "rects": [[0, 0, cols, 10]]}])
    out, _ = out_bytes(Deidentifier(pol, SECRET), pydicom.dcmread(path))
    assert out.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2.1"  # decoded, written uncompressed
    after = out.pixel_array
    assert after.shape == before.shape == (rows, cols, 3)
    assert (after[:10] == 0).all() and np.array_equal(after[10:], before[10:])


def test_curves_removed_whole_under_clean_graphics(phi_ds: Dataset) -> None:
    # Clean Graphics codes (50xx,xxxx) C, but there is no curve cleaner: Curve Data goes, so its
    # label/description text must go with it ("Curves (50xx,xxxx) are removed"), as for overlays.
    phi_ds.add_new(0x50002500, "LO", "ZEBEDIAH CURVE")  # Curve Label
    phi_ds.add_new(0x50020022, "LO", "ZEBEDIAH DESCR")  # Curve Description, second curve group
    phi_ds.add_new(0x50023000, "OW", b"\x01" * 8)
    out, blob = out_bytes(research(), phi_ds)
    assert not [e for e in out if 0x5000 <= e.tag.group <= 0x501E]
    assert b"ZEBEDIAH" not in blob


@pytest.mark.parametrize(("name_form", "text_form"), [("NFC", "NFD"), ("NFD", "NFD"), ("NFD", "NFC")])
def test_scrub_matches_names_across_unicode_normalization_forms(name_form: str, text_form: str) -> None:
    # A name typed precomposed (NFC) in PatientName and decomposed (NFD, e.g. from macOS) in a
    # retained description is the same name: the description must be scrubbed either way.
    import unicodedata

    ds = make_dataset(name=unicodedata.normalize(name_form, "Müllerström^Jürgen"))
    ds.SpecificCharacterSet = "ISO_IR 192"
    ds.SeriesDescription = unicodedata.normalize(text_form, "T1 Müllerström knee")
    out, _ = out_bytes(research(), roundtrip(ds))
    described = unicodedata.normalize("NFC", str(out.SeriesDescription))
    assert "Müllerström" not in described and "ller" not in described
    assert described.startswith("T1 ") and described.endswith(" knee")


def test_scrub_uses_inherited_character_set_for_values_removed_in_nested_items() -> None:
    # A sequence item has no (0008,0005) of its own: its text is in the character set it inherits
    # (UTF-8 here). A name removed inside the item must become a needle as the name, not as its
    # UTF-8 bytes read as Latin-1, so retained text naming it is scrubbed.
    from pydicom.sequence import Sequence

    ds = make_dataset(name="PLAIN^ASCII")
    ds.SpecificCharacterSet = "ISO_IR 192"
    item = Dataset()
    item.ValueType = "PNAME"
    item.PersonName = "Øyvindsen^Åse"
    ds.ContentSequence = Sequence([item])
    ds.StudyDescription = "Øyvindsen referral"
    out, _ = out_bytes(research(), roundtrip(ds))
    assert "Øyvindsen" not in str(out.StudyDescription)
    assert str(out.StudyDescription).endswith(" referral")


def test_vendor_block_names_and_codes_of_removed_items_do_not_scrub_kept_values() -> None:
    """pydicom's waveform_ecg.dcm: the private creator 'Mortara Instrument, Inc.' (removed with its
    block) became a scrub needle and turned the kept Manufacturer into X's; coding scheme designators
    and code meanings of removed sequence items (SCPECG, UCUM, 99_OFFIS_DCMTK) turned every kept code
    of that scheme into X's (reportsi.dcm, test-SR.dcm, waveform channel sources): invalid coded
    entries. Neither names a person. Private *values* and removed free text still scrub."""
    from pydicom.sequence import Sequence

    def code(value: str, scheme: str, meaning: str) -> Dataset:
        item = Dataset()
        item.CodeValue, item.CodingSchemeDesignator, item.CodeMeaning = value, scheme, meaning
        return item

    ds = make_dataset()
    ds.Manufacturer = "Mortara Instrument, Inc."
    ds.ManufacturerModelName = "ELI 250"
    ds.private_block(0x1455, "Mortara Instrument, Inc.", create=True).add_new(0x01, "LO", "ELI 250")
    ds.AcquisitionContextSequence = Sequence([code("5.6.3-9-1", "SCPECG", "Lead I (Einthoven)")])  # X
    ds.AnatomicRegionSequence = Sequence([code("5.6.3-9-2", "SCPECG", "Lead II")])  # kept
    out, _ = out_bytes(basic(), ds)
    assert not out.get("AcquisitionContextSequence") and not [e for e in out if e.tag.group == 0x1455]
    assert out.Manufacturer == "Mortara Instrument, Inc."
    assert out.AnatomicRegionSequence[0].CodingSchemeDesignator == "SCPECG"
    assert out.AnatomicRegionSequence[0].CodeMeaning == "Lead II"
    assert out.ManufacturerModelName == "XXXXXXX"  # a removed private value still scrubs kept text
    assert "QUIRINIUS" not in str(out).upper()

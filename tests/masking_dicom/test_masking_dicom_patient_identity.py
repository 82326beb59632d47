"""The patient identity an output carries: a pseudonymous PatientID derived by one documented rule
(docs/dicom-deid.md, "Patient identity"), the same key everywhere it is used (the output's
PatientID, the report, DicomDataset meta, the pipeline's patient split)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
from dicom_fixtures import POLICY_DIR, SECRET, roundtrip
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from securetrain.masking.dicom.dataset import DicomDataset
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import MissingPatientIdentityError
from securetrain.masking.dicom.policy import load_policy
from securetrain.masking.dicom.tree import FileOutcome, deidentify_tree

BASIC = POLICY_DIR / "dicom-basic.yaml"
LONGITUDINAL = POLICY_DIR / "dicom-research-longitudinal.yaml"
CT = "1.2.840.10008.5.1.4.1.1.2"


def _deid(policy: Path = BASIC, **update: object) -> Deidentifier:
    pol = load_policy(policy)
    if update:
        pol = load_policy(data={**pol.model_dump(mode="json"), **update})
    return Deidentifier(pol, SECRET)


def _image(study: str | None = None, **kw: object) -> Dataset:
    """A small CT image; no PatientID or PatientName unless given."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = CT
    ds.SOPClassUID = CT
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    if study != "":
        ds.StudyInstanceUID = study or generate_uid()
    ds.Modality = "CT"
    ds.BurnedInAnnotation = "NO"
    ds.Rows = ds.Columns = 4
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    ds.PixelData = np.arange(16, dtype=np.uint16).tobytes()
    for k, v in kw.items():
        setattr(ds, k, v)
    return ds


def _write(path: Path, ds: Dataset) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_dataset(ds))
    return path


# ---------------------------------------------------------------- the output always carries it
@pytest.mark.parametrize("policy", [BASIC, LONGITUDINAL])
def test_a_file_without_patient_id_gets_the_pseudonym_it_was_deidentified_under(policy: Path) -> None:
    deid = _deid(policy)
    out, report = deid.deidentify_dataset(roundtrip(_image(PatientName="DOE^JANE", PatientBirthDate="19700101")))
    assert report.patient_pseudonym and report.patient_pseudonym.startswith("ST")
    assert out.PatientID == report.patient_pseudonym  # was absent from the output
    assert str(out.PatientName) == report.patient_pseudonym
    back = pydicom.dcmread(pydicom.filebase.DicomBytesIO(encode_dataset(out)))
    assert back.PatientID == report.patient_pseudonym
    assert any(c.tag == 0x00100020 and c.action == "P" for c in report.changes)
    # the same patient in another file (another study) gets the same key; an empty PatientID
    # element is the same as none; another birth date is another patient
    same, r_same = deid.deidentify_dataset(roundtrip(_image(PatientName="DOE^JANE", PatientBirthDate="19700101")))
    empty, r_empty = deid.deidentify_dataset(roundtrip(_image(PatientID="", PatientName="DOE^JANE",
                                                             PatientBirthDate="19700101")))
    other, r_other = deid.deidentify_dataset(roundtrip(_image(PatientName="DOE^JANE", PatientBirthDate="19800101")))
    assert same.PatientID == empty.PatientID == out.PatientID
    assert r_same.patient_pseudonym == r_empty.patient_pseudonym == report.patient_pseudonym
    assert other.PatientID == r_other.patient_pseudonym != out.PatientID
    # a file with a PatientID keeps today's pseudonym: keyed HMAC of the original id
    with_id, r_id = deid.deidentify_dataset(roundtrip(_image(PatientID="MRN-1", PatientName="DOE^JANE")))
    assert with_id.PatientID == r_id.patient_pseudonym == deid.mapper.pseudonym("MRN-1")


@pytest.mark.parametrize("name", [None, "", "^^^^", " = "])
def test_no_patient_identity_is_refused_by_default(name: str | None) -> None:
    ds = _image() if name is None else _image(PatientName=name)
    with pytest.raises(MissingPatientIdentityError, match="no patient identity"):
        _deid().deidentify_dataset(roundtrip(ds))


def test_no_patient_identity_never_merges_patients_under_the_study_rule() -> None:
    """Before: every file without PatientID and PatientName got pseudonym("name:|"): one patient."""
    deid = _deid(missing_patient_identity="study")
    study_a, study_b = generate_uid(), generate_uid()
    a1, ra1 = deid.deidentify_dataset(roundtrip(_image(study_a)))
    a2, ra2 = deid.deidentify_dataset(roundtrip(_image(study_a, PatientName="")))
    b1, rb1 = deid.deidentify_dataset(roundtrip(_image(study_b)))
    assert a1.PatientID == a2.PatientID == ra1.patient_pseudonym == ra2.patient_pseudonym
    assert b1.PatientID == rb1.patient_pseudonym != a1.PatientID
    assert a1.PatientID == deid.mapper.pseudonym("study:" + study_a)
    assert a1.StudyInstanceUID != study_a  # the study UID is still remapped
    with pytest.raises(MissingPatientIdentityError, match="StudyInstanceUID"):
        deid.deidentify_dataset(roundtrip(_image("")))


def test_an_override_of_patient_id_decides_and_nothing_is_inserted() -> None:
    out, report = _deid(overrides={"PatientID": "X"}).deidentify_dataset(
        roundtrip(_image(PatientName="DOE^JANE", PatientBirthDate="19700101")))
    assert "PatientID" not in out and report.patient_pseudonym


# ---------------------------------------------------------------- the same key for every consumer
def test_tree_rejects_files_without_identity_and_writes_the_others_with_a_patient_id(tmp_path: Path) -> None:
    src = tmp_path / "in"
    _write(src / "a.dcm", _image(PatientName="DOE^JANE", PatientBirthDate="19700101"))
    _write(src / "b.dcm", _image(PatientName="DOE^JANE", PatientBirthDate="19700101"))
    _write(src / "c.dcm", _image())
    report = deidentify_tree(src, tmp_path / "out", load_policy(BASIC), SECRET)
    by_index = {r.index: r for r in report.results}
    assert by_index[3].outcome == FileOutcome.REJECTED and "no patient identity" in (by_index[3].reason or "")
    ids = {pydicom.dcmread(tmp_path / "out" / by_index[i].output).PatientID for i in (1, 2)}  # type: ignore[operator]
    assert len(ids) == 1 and ids.pop().startswith("ST")


def test_dataset_meta_and_pipeline_split_key_are_the_output_patient_id(tmp_path: Path) -> None:
    from securetrain.pipeline.tasks.dicom_shards import ShardSpec, output_name, run_shard

    files = [_write(tmp_path / "in" / f"{n}.dcm", ds) for n, ds in enumerate([
        _image(PatientName="DOE^JANE", PatientBirthDate="19700101"),
        _image(PatientName="DOE^JANE", PatientBirthDate="19700101"),
        _image(PatientName="ROE^RICHARD"),
        _image(),
    ])]
    out = tmp_path / "deid"
    out.mkdir()
    result = run_shard(ShardSpec(0, tuple((i, str(p)) for i, p in enumerate(files))), out, BASIC, SECRET)
    assert [r.outcome for r in result.rows] == ["written", "written", "written", "rejected"]
    assert result.rows[3].reason == "missing_patient_identity"
    for row in result.rows[:3]:  # the split key is the PatientID the output carries
        assert pydicom.dcmread(out / output_name(row.row)).PatientID == row.pseudonym != ""
    assert result.rows[0].pseudonym == result.rows[1].pseudonym != result.rows[2].pseudonym
    # DicomDataset over the raw files: the same key in meta; the file without identity quarantined
    manifest = tmp_path / "in" / "manifest.csv"
    manifest.write_text("path,label\n" + "".join(f"{p.name},0\n" for p in files))
    data = DicomDataset(manifest, BASIC, SECRET, size=4)
    assert [data[i]["meta"]["PatientID"] for i in range(len(data))] == [r.pseudonym for r in result.rows[:3]]
    [entry] = data.quarantine_report()
    assert entry["path"] == "3.dcm" and "no patient identity" in entry["reason"]


# ---------------------------------------------------------------- persons named inside sequences
def _item(**kw: object) -> Dataset:
    d = Dataset()
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def _group_scan() -> Dataset:
    """A group scan: the object's patient plus other patients named in items, one level down (a
    sequence the safety net keeps), one under a policy-kept sequence, and three levels deep."""
    from pydicom.sequence import Sequence

    ds = _image(PatientID="MAIN-1", PatientName="MAIN^PATIENT", PatientBirthDate="19600101")
    ds.GroupOfPatientsIdentificationSequence = Sequence([  # (0010,0027): not in Table E.1-1, kept
        _item(PatientID="OTHER-2", PatientName="OTHER^PERSON"),
        _item(PatientName="THIRD^PERSON", PatientBirthDate="19900202"),
        _item(PatientID="MAIN-1"),  # the object's patient under the same id
        _item(PatientID=""),  # an empty id stays empty
    ])
    ds.OtherPatientIDsSequence = Sequence([_item(PatientID="NHS-777", IssuerOfPatientID="NHS")])
    deep = _item(PatientName="DEEP^FOURTH")
    ds.ReferencedInstanceSequence = Sequence([_item(ReferencedSeriesSequence=Sequence([
        _item(DerivationImageSequence=Sequence([_item(), deep]))]))])  # unlisted sequences, 3 deep
    return ds


def test_persons_inside_sequences_get_their_own_pseudonym_never_the_patients() -> None:
    """Before: a nested PatientName got the object's patient's pseudonym (and an empty nested
    PatientID too), so two people shared one identity."""
    deid = _deid(overrides={"OtherPatientIDsSequence": "K"})
    out, report = deid.deidentify_dataset(roundtrip(_group_scan()))
    main = report.patient_pseudonym
    assert out.PatientID == str(out.PatientName) == main == deid.mapper.pseudonym("MAIN-1")
    group = out.GroupOfPatientsIdentificationSequence
    other = deid.mapper.pseudonym("OTHER-2")
    third = deid.mapper.pseudonym("name:THIRD^PERSON|19900202")
    assert group[0].PatientID == str(group[0].PatientName) == other != main
    assert str(group[1].PatientName) == third and third not in (main, other)
    assert group[2].PatientID == main  # the same identity: the same pseudonym
    assert group[3].PatientID in (None, "")
    assert out.OtherPatientIDsSequence[0].PatientID == deid.mapper.pseudonym("NHS-777")
    deep = out.ReferencedInstanceSequence[0].ReferencedSeriesSequence[0].DerivationImageSequence[1]
    assert str(deep.PatientName) == deid.mapper.pseudonym("name:DEEP^FOURTH|") not in (main, other, third)
    # no original value is left anywhere, and each identity is in the mapping export
    raw = encode_dataset(out)
    for original in (b"MAIN-1", b"OTHER-2", b"OTHER^PERSON", b"THIRD", b"NHS-777", b"DEEP^FOURTH"):
        assert original not in raw
    assert {"MAIN-1", "OTHER-2", "name:THIRD^PERSON|19900202", "NHS-777", "name:DEEP^FOURTH|"} <= set(deid.pseudonyms)
    # the nested person is the same pseudonymous patient as in a file of their own
    own, own_report = deid.deidentify_dataset(roundtrip(_image(PatientID="OTHER-2", PatientName="OTHER^PERSON")))
    assert own.PatientID == own_report.patient_pseudonym == other


@pytest.mark.parametrize("mode, action", [("empty", "Z"), ("remove", "X")])
def test_nested_patient_identity_can_be_emptied_or_removed(mode: str, action: str) -> None:
    deid = _deid(nested_patient_identity=mode)
    out, report = deid.deidentify_dataset(roundtrip(_group_scan()))
    assert out.PatientID == str(out.PatientName) == report.patient_pseudonym  # the object's patient
    nested = [i for i in out.GroupOfPatientsIdentificationSequence]
    deep = out.ReferencedInstanceSequence[0].ReferencedSeriesSequence[0].DerivationImageSequence[1]
    for item in [*nested, deep]:
        for kw in ("PatientID", "PatientName"):
            if mode == "remove":
                assert kw not in item
            else:
                assert str(item.get(kw, "") or "") == ""
    assert any("[" in c.path and c.tag == 0x00100010 and c.action == action for c in report.changes)
    assert b"OTHER-2" not in encode_dataset(out) and b"THIRD" not in encode_dataset(out)


def test_an_override_decides_the_tag_at_every_depth() -> None:
    out, _ = _deid(overrides={"PatientName": "X"}).deidentify_dataset(roundtrip(_group_scan()))
    assert "PatientName" not in out
    assert all("PatientName" not in i for i in out.GroupOfPatientsIdentificationSequence)
    assert out.GroupOfPatientsIdentificationSequence[0].PatientID.startswith("ST")  # not overridden


def test_nested_persons_under_retain_uids_and_multi_item_sequences() -> None:
    """Retain UIDs keeps Referenced Patient Sequence (K): its items name other patients."""
    from pydicom.sequence import Sequence

    ds = _image(PatientID="MAIN-1", PatientName="MAIN^PATIENT")
    ds.ReferencedPatientSequence = Sequence([
        _item(ReferencedSOPClassUID="1.2.840.10008.3.1.2.1.1", ReferencedSOPInstanceUID=generate_uid(),
              PatientName=f"REF^PERSON{i}", PatientID=f"REF-{i}") for i in range(3)])
    deid = _deid(options=["retain_uids"])
    out, report = deid.deidentify_dataset(roundtrip(ds))
    pseudonyms = [(i.PatientID, str(i.PatientName)) for i in out.ReferencedPatientSequence]
    assert pseudonyms == [(deid.mapper.pseudonym(f"REF-{i}"),) * 2 for i in range(3)]
    assert report.patient_pseudonym not in {p for pair in pseudonyms for p in pair}


# ---------------------------------------------------------------- dates of persons named inside sequences
def _dated_group_scan() -> Dataset:
    """A group scan whose items carry dates: another patient (by PatientID), a third one (by name +
    birth date) with a dated sub-item, the object's own patient, and an item that names nobody."""
    from pydicom.sequence import Sequence

    ds = _image(PatientID="MAIN-1", PatientName="MAIN^PATIENT", PatientBirthDate="19600101",
                StudyDate="20200315")
    ds.GroupOfPatientsIdentificationSequence = Sequence([
        _item(PatientID="OTHER-2", PatientName="OTHER^PERSON", StudyDate="20200315",
              LastMenstrualDate="20200301", ObservationDateTime="20200315101500"),
        _item(PatientName="THIRD^PERSON", PatientBirthDate="19900202", StudyDate="20200315",
              ContentSequence=Sequence([_item(ObservationDateTime="20200316080000",
                                              ContentSequence=Sequence([_item(Date="20200317")]))])),
        _item(PatientID="MAIN-1", StudyDate="20200315"),
        _item(StudyDate="20200315"),  # names nobody: the enclosing (object's) patient's dates
    ])
    return ds


def _own_offset(deid: Deidentifier, identity: str) -> int:
    """The offset a person's dates get at the top level of their own file."""
    return deid.mapper.day_offset(deid.mapper.pseudonym(identity))


@pytest.mark.parametrize("mode", ["pseudonymise", "empty", "remove"])
def test_dates_of_a_nested_person_shift_by_that_persons_own_offset(mode: str) -> None:
    """Before: every date in the object moved by the object's patient's offset, so an item naming
    another person had that person's dates shifted by someone else's offset (anyone who knew the
    object's patient's real dates could undo the shift of the other person's)."""
    from securetrain.masking.dicom.dates import shift_da, shift_dt

    deid = _deid(LONGITUDINAL, nested_patient_identity=mode)
    out, _ = deid.deidentify_dataset(roundtrip(_dated_group_scan()))
    main = _own_offset(deid, "MAIN-1")
    other = _own_offset(deid, "OTHER-2")
    third = _own_offset(deid, "name:THIRD^PERSON|19900202")
    assert len({main, other, third}) == 3  # the fixture must tell the offsets apart
    assert out.StudyDate == shift_da("20200315", main)
    g = out.GroupOfPatientsIdentificationSequence
    assert g[0].StudyDate == shift_da("20200315", other)
    assert g[0].LastMenstrualDate == shift_da("20200301", other)
    assert g[0].ObservationDateTime == shift_dt("20200315101500", other)
    assert g[1].StudyDate == shift_da("20200315", third)
    sub = g[1].ContentSequence[0]  # sub-items that name nobody belong to the enclosing person
    assert sub.ObservationDateTime == shift_dt("20200316080000", third)
    assert sub.ContentSequence[0].Date == shift_da("20200317", third)
    assert g[2].StudyDate == shift_da("20200315", main)  # the object's patient under its own id
    assert g[3].StudyDate == shift_da("20200315", main)
    # the nested person's dates are those of their own file
    own, _ = deid.deidentify_dataset(roundtrip(_image(PatientID="OTHER-2", StudyDate="20200315")))
    assert own.StudyDate == g[0].StudyDate
    if mode == "pseudonymise":
        assert g[0].PatientID == deid.mapper.pseudonym("OTHER-2")

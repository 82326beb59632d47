"""The synthetic DICOM generator: valid Part-10 files, PHI where claimed, deterministic, deep nesting."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import ExplicitVRLittleEndian

from securetrain.masking.dicom.synthetic import (
    PRIVATE_CREATOR,
    SOP_CLASSES,
    generate_one,
    generate_study_set,
    load_phi_manifest,
    phi_report,
    phi_values,
)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_study_set(tmp_path_factory.mktemp("syn"), n_patients=3, images_per_series=3, seed=7,
                              include_burned_in=True)


def _rows(manifest: Path) -> list[tuple[Path, int]]:
    with manifest.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == ["path", "label"]
        return [(manifest.parent / r["path"], int(r["label"])) for r in reader]


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _max_depth_of(ds: pydicom.Dataset, predicate, depth: int = 0) -> int:
    best = -1
    for elem in ds:
        if elem.VR == "SQ":
            for item in elem.value:
                best = max(best, _max_depth_of(item, predicate, depth + 1))
        elif predicate(elem):
            best = max(best, depth)
    return best


def test_manifest_and_files_are_valid_part10(study: Path) -> None:
    rows = _rows(study)
    assert len(rows) == 3 * (2 * 3 + 2)  # 2 studies x 3 images + US + SC per patient
    assert {label for _, label in rows} == {0, 1}
    for path, _ in rows:
        raw = path.read_bytes()
        assert raw[128:132] == b"DICM"  # preamble + prefix: a real Part-10 file
        ds = pydicom.dcmread(path)
        assert ds.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
        assert ds.SOPClassUID in SOP_CLASSES.values()
        assert ds.file_meta.MediaStorageSOPInstanceUID == ds.SOPInstanceUID
        assert ds.pixel_array.dtype == np.uint16 and ds.pixel_array.shape == (32, 32)
    modalities = {pydicom.dcmread(p).Modality for p, _ in rows}
    assert modalities == {"CT", "MR", "US", "SC"}


def test_pixels_encode_label(study: Path) -> None:
    peaks = {0: [], 1: []}
    for path, label in _rows(study):
        ds = pydicom.dcmread(path)
        if ds.BurnedInAnnotation == "YES":
            continue
        peaks[label].append(int(ds.pixel_array.max()))
    assert peaks[0] and peaks[1]
    assert max(peaks[0]) < 1400 < min(peaks[1])  # a threshold separates the classes: learnable


def test_phi_present_where_claimed(study: Path) -> None:
    doc = load_phi_manifest(study)
    assert set(doc["files"]) == {str(p.relative_to(study.parent)) for p, _ in _rows(study)}
    for rel, rep in doc["files"].items():
        raw = (study.parent / rel).read_bytes()
        for value in rep["text"] + rep["dates"] + rep["uids"]:
            if " " in value and value[0].isupper() and value.count(" ") == 1 and "^" not in value:
                continue  # display-form names ("John Doe") occur inside free text, checked below
            assert value.encode() in raw, (rel, value)
        ds = pydicom.dcmread(study.parent / rel)
        assert phi_report(ds) == rep  # same answer from disk as from memory
    ds = pydicom.dcmread(next(iter(_rows(study)))[0])
    name = str(ds.PatientName)
    first_last = f"{name.split('^')[1].title()} {name.split('^')[0].title()}"
    assert first_last in str(ds.StudyDescription)  # names inside descriptions
    for keyword in ("PatientID", "PatientBirthDate", "PatientAddress", "PatientTelephoneNumbers", "OtherPatientIDs",
                    "InstitutionName", "InstitutionAddress", "ReferringPhysicianName", "OperatorsName",
                    "StationName", "DeviceSerialNumber", "AccessionNumber", "StudyID", "StudyDate", "SeriesDate",
                    "AcquisitionDateTime", "ContentDate", "PatientAge", "PatientSex", "FrameOfReferenceUID"):
        assert str(ds.data_element(keyword).value), keyword
    values = phi_values(ds)
    assert name in values and ds.PatientID in values and ds.StudyInstanceUID in values and ds.StudyDate in values
    assert ds.StudyInstanceUID not in phi_values(ds, include_uids=False)
    assert ds.StudyDate not in phi_values(ds, include_dates=False)
    assert all(not v.startswith("1.2.840.10008.") for v in values)  # well-known SOP class UIDs are not PHI


def test_nested_private_overlay(study: Path) -> None:
    ds = pydicom.dcmread(next(iter(_rows(study)))[0])
    name = str(ds.PatientName)
    # PatientName-valued PN at depth >= 3, both in standard and in private sequences.
    assert _max_depth_of(ds, lambda e: e.VR == "PN" and str(e.value) == name) >= 3
    deep = ds.RequestAttributesSequence[0].ReferencedStudySequence[0].ContentSequence[0]
    assert str(deep.PersonName) == name
    assert ds.RequestAttributesSequence[0].ReferencedStudySequence[0].ReferencedSOPInstanceUID == ds.StudyInstanceUID
    block = ds.private_block(0x0011, PRIVATE_CREATOR)
    assert str(block[0x01].value) == name and block[0x02].value == ds.PatientID
    inner = block[0x05].value[0]
    inner_block = inner.private_block(0x0011, PRIVATE_CREATOR)
    assert str(inner_block[0x11].value[0].PatientName) == name
    assert (0x6000, 0x3000) in ds and ds.overlay_array(0x6000).shape == (32, 32)
    assert ds.overlay_array(0x6000).sum() > 0
    assert "Marked by" in ds[0x6000, 0x0022].value
    # Sibling links: every ReferencedSOPInstanceUID in the image sequence is a real SOP in the set.
    sops = {pydicom.dcmread(p).SOPInstanceUID for p, _ in _rows(study)}
    assert ds.ReferencedImageSequence[0].ReferencedSOPInstanceUID in sops


def test_burned_in_files(study: Path) -> None:
    burned = [pydicom.dcmread(p) for p, _ in _rows(study) if pydicom.dcmread(p).BurnedInAnnotation == "YES"]
    assert {d.Modality for d in burned} == {"US", "SC"} and len(burned) == 6
    assert all(d.pixel_array[0].max() == 4095 for d in burned)


def test_deterministic_for_seed(tmp_path: Path) -> None:
    kw = dict(n_patients=2, studies_per_patient=1, images_per_series=2, image_size=16)
    a = generate_study_set(tmp_path / "a", seed=3, **kw).parent
    b = generate_study_set(tmp_path / "b", seed=3, **kw).parent
    c = generate_study_set(tmp_path / "c", seed=4, **kw).parent
    assert _tree_digest(a) == _tree_digest(b)
    assert _tree_digest(a) != _tree_digest(c)
    names_a = {str(pydicom.dcmread(p).PatientName) for p in a.rglob("*.dcm")}
    assert len(names_a) == 2  # distinct patients have distinct names


def test_generate_one_and_bad_args(tmp_path: Path) -> None:
    ds = generate_one(seed=1, modality="MR", label=0, path=tmp_path / "x.dcm")
    back = pydicom.dcmread(tmp_path / "x.dcm")
    assert back.SOPClassUID == SOP_CLASSES["MR"] and back.PatientName == ds.PatientName
    assert back.pixel_array.max() < 1400
    with pytest.raises(ValueError):
        generate_one(modality="XX")
    with pytest.raises(ValueError):
        generate_study_set(tmp_path / "bad", modalities=("PET",))

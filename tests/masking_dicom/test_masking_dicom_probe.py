"""Real-world file structures found by probing (hospital exports, CDs): each failed before its fix."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pydicom
import pytest
from dicom_fixtures import POLICY_DIR, SECRET
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from securetrain.masking.dicom.engine import Deidentifier, read_dicom
from securetrain.masking.dicom.errors import DicomDirectoryError
from securetrain.masking.dicom.policy import load_policy
from securetrain.masking.dicom.tree import FileOutcome, deidentify_tree

BASIC = POLICY_DIR / "dicom-basic.yaml"
MEDIA_STORAGE_DIRECTORY = "1.2.840.10008.1.3.10"


def _image() -> Dataset:
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    ds.SOPInstanceUID = generate_uid()
    ds.file_meta.MediaStorageSOPClassUID = ds.SOPClassUID
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.StudyInstanceUID = generate_uid()
    ds.Modality = "CT"
    ds.PatientID = "PID-4711"
    ds.PatientName = "MUELLER^JUERGEN"
    ds.Rows = ds.Columns = 2
    ds.BitsAllocated = ds.BitsStored = 16
    ds.HighBit = 15
    ds.PixelRepresentation = 0
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.PixelData = np.arange(4, dtype=np.uint16).tobytes()
    return ds


def _dicomdir() -> Dataset:
    """A CD's DICOMDIR: Media Storage Directory, no SOP Class in the data set, PHI in its records."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = MEDIA_STORAGE_DIRECTORY
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.FileSetID = "MUELLER"
    ds.OffsetOfTheFirstDirectoryRecordOfTheRootDirectoryEntity = 0
    ds.OffsetOfTheLastDirectoryRecordOfTheRootDirectoryEntity = 0
    ds.FileSetConsistencyFlag = 0
    rec = Dataset()
    rec.OffsetOfTheNextDirectoryRecord = 0
    rec.RecordInUseFlag = 0xFFFF
    rec.OffsetOfReferencedLowerLevelDirectoryEntity = 0
    rec.DirectoryRecordType = "PATIENT"
    rec.PatientID = "PID-4711"
    rec.PatientName = "MUELLER^JUERGEN"
    ds.DirectoryRecordSequence = Sequence([rec])
    return ds


def test_a_dicomdir_in_the_folder_is_rejected_with_its_own_reason_not_quarantined(tmp_path: Path) -> None:
    src, dst = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _dicomdir().save_as(src / "DICOMDIR", enforce_file_format=True)
    _image().save_as(src / "IM0001", enforce_file_format=True)
    report = deidentify_tree(src, dst, load_policy(BASIC), SECRET)
    by_name = {Path(r.source).name: r for r in report.results}
    assert by_name["IM0001"].outcome == FileOutcome.WRITTEN
    d = by_name["DICOMDIR"]
    assert d.outcome == FileOutcome.REJECTED, d.reason  # a CD's index, not a truncated object: run exits 0
    assert "DICOMDIR" in (d.reason or "") and "truncated" not in (d.reason or "")
    assert "MUELLER" not in (d.reason or "") and "4711" not in (d.reason or "")
    assert report.quarantined == 0
    outputs = list(dst.iterdir())
    assert len(outputs) == 1 and b"MUELLER" not in outputs[0].read_bytes()


def test_a_dicomdir_is_refused_by_the_library_calls_too(tmp_path: Path) -> None:
    path = tmp_path / "DICOMDIR"
    _dicomdir().save_as(path, enforce_file_format=True)
    deid = Deidentifier(load_policy(BASIC), SECRET)
    with pytest.raises(DicomDirectoryError, match="DICOMDIR"):
        deid.deidentify_file(path, tmp_path / "out.dcm")
    assert not (tmp_path / "out.dcm").exists()
    with pytest.raises(DicomDirectoryError):
        deid.deidentify_dataset(pydicom.dcmread(path))


def test_a_file_with_the_dicm_prefix_but_no_preamble_is_read() -> None:
    """Some exporters write "DICM" + file meta without the 128-byte preamble."""
    buf = io.BytesIO()
    ds = _image()
    ds.save_as(buf, enforce_file_format=True)
    data = buf.getvalue()
    assert data[128:132] == b"DICM"
    back = read_dicom(io.BytesIO(data[128:]), name="x")
    assert back.SOPInstanceUID == ds.SOPInstanceUID
    assert back.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian

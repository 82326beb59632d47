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


def _strict_texts(data: bytes) -> dict[str, str]:
    """Every text value of the written file decoded strictly with the file's own character set
    (pydicom raises instead of substituting replacement characters)."""
    from pydicom import config

    old = config.settings.reading_validation_mode
    config.settings.reading_validation_mode = config.RAISE
    try:
        ds = pydicom.dcmread(io.BytesIO(data))
        return {e.keyword: str(e.value) for e in ds.iterall() if e.VR in ("SH", "LO", "ST", "LT", "UT", "UC", "PN")}
    finally:
        config.settings.reading_validation_mode = old


def _with_raw_text(charset: str | list[str] | None, **raw: bytes) -> bytes:
    ds = _image()
    del ds.PatientName
    if charset is not None:
        ds.SpecificCharacterSet = charset
    tags = {"PatientName": (0x00100010, "PN"), "StudyDescription": (0x00081030, "LO"),
            "SeriesDescription": (0x0008103E, "LO"), "InstitutionName": (0x00080080, "LO")}
    for kw, value in raw.items():
        tag, vr = tags[kw]
        ds.add_new(tag, vr, value)
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


LATIN1_TEXT = {"PatientName": b"M\xfcller^J\xfcrgen", "StudyDescription": b"Scan M\xfcller",
               "SeriesDescription": b"S\xe9rie \xe9t\xe9"}


@pytest.mark.parametrize("charset", ["ISO_IR 192", "UTF-8", None, "ISO_IR 999", ["ISO_IR 192", "ISO_IR 100"]])
def test_text_that_contradicts_its_character_set_is_written_as_valid_utf8(tmp_path: Path, charset: object) -> None:
    """Latin-1 bytes under a UTF-8 (or missing, or unknown) character set: the output must decode
    strictly with the character set it declares."""
    src = tmp_path / "in.dcm"
    src.write_bytes(_with_raw_text(charset, **LATIN1_TEXT))  # type: ignore[arg-type]
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml"), SECRET)
    deid.deidentify_file(src, tmp_path / "out.dcm")
    data = (tmp_path / "out.dcm").read_bytes()
    texts = _strict_texts(data)
    assert pydicom.dcmread(io.BytesIO(data)).SpecificCharacterSet == "ISO_IR 192"
    assert "ller" not in texts["StudyDescription"]  # still scrubbed
    # decoded as pydicom reads it (Latin-1 by default, U+FFFD where the declared codec fails)
    assert texts["SeriesDescription"][0] == "S" and texts["SeriesDescription"][-2:] in ("t\ufffd", "t\u00e9")


@pytest.mark.parametrize(("alias", "term"), [("ISO-8859-1", "ISO_IR 100"), ("latin1", "ISO_IR 100"),
                                             ("ISO_IR100", "ISO_IR 100"), ("UTF8", "ISO_IR 192")])
def test_a_misspelt_character_set_is_written_as_its_defined_term(tmp_path: Path, alias: str, term: str) -> None:
    src = tmp_path / "in.dcm"
    text = {"SeriesDescription": "Série été".encode("utf-8" if term == "ISO_IR 192" else "latin-1"),
            "PatientName": "Müller^Jürgen".encode("utf-8" if term == "ISO_IR 192" else "latin-1")}
    src.write_bytes(_with_raw_text(alias, **text))
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml"), SECRET)
    deid.deidentify_file(src, tmp_path / "out.dcm")
    data = (tmp_path / "out.dcm").read_bytes()
    assert pydicom.dcmread(io.BytesIO(data)).SpecificCharacterSet == term
    assert _strict_texts(data)["SeriesDescription"] == "Série été"


@pytest.mark.parametrize(("charset", "encoding"), [("ISO_IR 100", "latin-1"), ("ISO_IR 192", "utf-8")])
def test_valid_text_keeps_its_character_set_and_bytes(tmp_path: Path, charset: str, encoding: str) -> None:
    src = tmp_path / "in.dcm"
    src.write_bytes(_with_raw_text(charset, PatientName="Müller^Jürgen".encode(encoding),
                                   SeriesDescription="Série été".encode(encoding)))
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml"), SECRET)
    deid.deidentify_file(src, tmp_path / "out.dcm")
    data = (tmp_path / "out.dcm").read_bytes()
    assert pydicom.dcmread(io.BytesIO(data)).SpecificCharacterSet == charset
    assert "Série été".encode(encoding) in data


@pytest.mark.parametrize("actual_implicit", [True, False])
def test_a_data_set_encoded_against_its_transfer_syntax_is_written_in_the_encoding_it_has(
    tmp_path: Path, actual_implicit: bool
) -> None:
    """Old tools label Implicit VR data sets Explicit VR Little Endian (and the reverse); pydicom
    reads them by looking, and the output must be written, not refused as unencodable."""
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset, write_file_meta_info
    from pydicom.uid import ImplicitVRLittleEndian

    ds = _image()
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.StudyDescription = "CT Mueller"
    ref = Dataset()
    ref.ReferencedSOPClassUID = ds.SOPClassUID
    ref.ReferencedSOPInstanceUID = "1.2.3.4.100"
    ds.ReferencedImageSequence = Sequence([ref])
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian if actual_implicit else ImplicitVRLittleEndian
    fp = DicomBytesIO()
    fp.write(b"\0" * 128 + b"DICM")
    write_file_meta_info(fp, ds.file_meta)
    fp.is_little_endian, fp.is_implicit_VR = True, actual_implicit
    write_dataset(fp, ds)
    src = tmp_path / "in.dcm"
    src.write_bytes(fp.getvalue())
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-research-longitudinal.yaml"), SECRET)
    with pytest.warns(UserWarning, match="VR"):
        deid.deidentify_file(src, tmp_path / "out.dcm")
    out = pydicom.dcmread(tmp_path / "out.dcm")
    assert out.StudyDescription == "CT XXXXXXX"
    assert out.ReferencedImageSequence[0].ReferencedSOPInstanceUID.startswith("2.25.")
    assert out.PixelData == ds.PixelData and out.Rows == 2
    assert out.file_meta.TransferSyntaxUID == (ImplicitVRLittleEndian if actual_implicit else ExplicitVRLittleEndian) \
        or not actual_implicit

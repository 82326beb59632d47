"""Fixtures for the DICOM de-identification tests: a hand-built PHI-laden dataset."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
POLICY_DIR = Path(__file__).resolve().parents[2] / "policies"

CT_IMAGE = "1.2.840.10008.5.1.4.1.1.2"
SR_DOC = "1.2.840.10008.5.1.4.1.1.88.33"
ENCAPSULATED_PDF = "1.2.840.10008.5.1.4.1.1.104.1"
# A PDF whose text names the patient: what metadata de-identification cannot clean.
PDF_WITH_PHI = b"%PDF-1.4\n1 0 obj (Discharge letter: QUIRINIUS BARTHOLOMEW, MRN PID-7734-QQ) endobj\n%%EOF\n"


def _item(**kw: object) -> Dataset:
    d = Dataset()
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def make_dataset(
    *,
    patient_id: str = "PID-7734-QQ",
    name: str = "QUIRINIUS^BARTHOLOMEW",
    study_date: str = "20190314",
    sop_uid: str = "1.3.6.1.4.1.99999.1.2.3.4.100",
    ref_uid: str = "1.3.6.1.4.1.99999.1.2.3.4.200",
    modality: str = "CT",
) -> Dataset:
    """A CT image with PHI at the top level, 3-deep nested sequences, private blocks, an SR-like
    content tree, an overlay plane, a curve group, and a retained description mentioning the name."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = CT_IMAGE
    ds.file_meta.MediaStorageSOPInstanceUID = sop_uid
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.SourceApplicationEntityTitle = "HOSPITALPACS7"
    ds.SOPClassUID = CT_IMAGE
    ds.SOPInstanceUID = sop_uid
    ds.StudyInstanceUID = "1.3.6.1.4.1.99999.1.2.3.4.1"
    ds.SeriesInstanceUID = "1.3.6.1.4.1.99999.1.2.3.4.2"
    ds.FrameOfReferenceUID = "1.3.6.1.4.1.99999.1.2.3.4.3"
    ds.PatientID = patient_id
    ds.PatientName = name
    ds.PatientBirthDate = "19610723"
    ds.PatientSex = "F"
    ds.PatientAge = "057Y"
    ds.PatientWeight = "61.5"
    ds.PatientAddress = "17 Wisteria Crescent, Lowerbury"
    ds.OtherPatientIDs = "MRN-55512093"
    ds.AccessionNumber = "ACC99188231"
    ds.StudyID = "STUDY8812"
    ds.StudyDate = study_date
    ds.StudyTime = "101530.250"
    ds.SeriesDate = study_date
    ds.ContentDate = study_date
    ds.AcquisitionDateTime = study_date + "101533.000000+0100"
    ds.InstanceCreationDate = study_date  # X/D since the 2025b table
    ds.ExpiryDate = study_date  # (0014,1020) not in Table E.1-1: VR safety net
    ds.InstitutionName = "Saint Quiteria Infirmary"
    ds.InstitutionAddress = "1 Infirmary Way, Lowerbury"
    ds.StationName = "CTSTATION-QX9"
    ds.DeviceSerialNumber = "SER-44721-Z"
    ds.ReferringPhysicianName = "HALLORAN^WILHELMINA"
    ds.OperatorsName = "PEMBERTON^AUGUSTINE"
    ds.StudyDescription = "CT chest for Bartholomew Quirinius"
    ds.SeriesDescription = "AXIAL QUIRINIUS 5mm"
    ds.ImageComments = "called patient on 555-0199"
    ds.Modality = modality
    ds.Manufacturer = "ACME Imaging"
    ds.BodyPartExamined = "CHEST"
    ds.BurnedInAnnotation = "NO"
    ds.TimezoneOffsetFromUTC = "+0100"
    # References: nested three deep, UIDs must be remapped consistently.
    ref_img = _item(ReferencedSOPClassUID=CT_IMAGE, ReferencedSOPInstanceUID=ref_uid)
    ds.ReferencedImageSequence = Sequence([ref_img])
    deep = _item(
        ReferencedSOPClassUID=CT_IMAGE,
        ReferencedSOPInstanceUID=sop_uid,
        PersonName="DEEPNESTED^OSWALDINE",
    )
    mid = _item(ReferencedSeriesSequence=Sequence([_item(SeriesInstanceUID=ds.SeriesInstanceUID,
                                                          ReferencedInstanceSequence=Sequence([deep]))]))
    ds.ReferencedStudySequence = Sequence([_item(ReferencedSOPClassUID=CT_IMAGE,
                                                 ReferencedSOPInstanceUID=ds.StudyInstanceUID)])
    ds.SourceImageSequence = Sequence([_item(ReferencedSOPClassUID=CT_IMAGE, ReferencedSOPInstanceUID=ref_uid,
                                             DerivationDescription="from scan of Quirinius")])
    # An unlisted sequence (kept + recursed) hiding PHI three levels down.
    ds.ReferencedInstanceSequence = Sequence([mid])
    ds.RequestAttributesSequence = Sequence([_item(RequestedProcedureID="RP-99812",
                                                   ScheduledProcedureStepID="SPS-44120")])
    # SR-like content tree (Content Sequence row is D; with clean_structured_content it's C).
    leaf = _item(RelationshipType="HAS OBS CONTEXT", ValueType="PNAME", PersonName="OBSERVER^FENWICK")
    text = _item(RelationshipType="CONTAINS", ValueType="TEXT", TextValue="Findings for Quirinius: normal",
                 ContentSequence=Sequence([leaf]))
    ds.ContentSequence = Sequence([text])
    # Private blocks: one "safe" (allow-listable) and one with PHI, plus a nested private SQ.
    block = ds.private_block(0x0029, "ACME SAFE 1.0", create=True)
    block.add_new(0x10, "DS", "2.5")  # e.g. a vendor dose scale
    block.add_new(0x11, "LO", "PRIVATE-PHI-QUIRINIUS")
    other = ds.private_block(0x0033, "ACME PHI", create=True)
    other.add_new(0x01, "LO", "PRIV-MRN-7781234")
    other.add_new(0x02, "SQ", Sequence([_item(PatientID="NESTED-PRIV-ID-3321")]))
    # Overlay plane and curve (retired) group.
    ds.add_new(0x60000010, "US", 8)
    ds.add_new(0x60000011, "US", 8)
    ds.add_new(0x60000040, "CS", "G")
    ds.add_new(0x60000050, "SS", [1, 1])
    ds.add_new(0x60000100, "US", 1)
    ds.add_new(0x60003000, "OW", b"\x01" * 8)
    ds.add_new(0x60004000, "LT", "overlay note by HALLORAN")
    ds.add_new(0x50000005, "US", 1)
    ds.add_new(0x50003000, "OW", b"\x02" * 8)
    # Pixels.
    ds.Rows, ds.Columns = 8, 8
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, 16, 15
    ds.PixelRepresentation = 0
    ds.PixelData = np.arange(64, dtype=np.uint16).reshape(8, 8).tobytes()
    return ds


def make_encapsulated_pdf(document: bytes = PDF_WITH_PHI, sop_class: str = ENCAPSULATED_PDF) -> Dataset:
    """An Encapsulated PDF Storage object (PS3.3 A.45.1) whose document text carries PHI."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = sop_class
    ds.file_meta.MediaStorageSOPInstanceUID = "1.3.6.1.4.1.99999.1.2.3.4.900"
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = sop_class
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID = "1.3.6.1.4.1.99999.1.2.3.4.901"
    ds.SeriesInstanceUID = "1.3.6.1.4.1.99999.1.2.3.4.902"
    ds.PatientID = "PID-7734-QQ"
    ds.PatientName = "QUIRINIUS^BARTHOLOMEW"
    ds.Modality = "DOC"
    ds.BurnedInAnnotation = "YES"  # Type 1 in the module: the document may hold identifying text
    ds.DocumentTitle = "Discharge letter QUIRINIUS"
    ds.MIMETypeOfEncapsulatedDocument = "application/pdf"
    ds.EncapsulatedDocument = document + b"\x00" * (len(document) % 2)
    ds.EncapsulatedDocumentLength = len(document)
    return ds


def roundtrip(ds: Dataset) -> Dataset:
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return pydicom.dcmread(io.BytesIO(buf.getvalue()))


@contextlib.contextmanager
def gdcm_read(blob: bytes) -> Iterator[Any]:
    """GDCM's reading of ``blob`` (an independent decoder): its ``gdcm.ImageReader`` after ``Read()``
    (``None`` if GDCM cannot read it), or ``None`` without python-gdcm (a dependency, so rare)."""
    try:
        import gdcm
    except ImportError:  # pragma: no cover - python-gdcm is a dependency
        yield None
        return
    fd, name = tempfile.mkstemp(suffix=".dcm")
    try:
        os.write(fd, blob)
        os.close(fd)
        reader = gdcm.ImageReader()
        reader.SetFileName(name)
        yield reader if reader.Read() else None
    finally:
        os.unlink(name)

"""Synthetic, PHI-laden DICOM studies for tests and demos.

Real patient data can never live in a test suite, yet de-identification must be tested against
files that look like what hospitals produce: PHI in the obvious tags, in free-text descriptions,
in nested sequences (depth >= 3), in private creator blocks, in overlay planes, and linked by UIDs.
This module writes such files, deterministically for a seed, as valid DICOM Part-10
(file meta + Explicit VR Little Endian, real SOP classes).

The pixel data encodes the label so a small CNN can learn it: label 1 = a bright Gaussian blob at
a random position on a noisy background, label 0 = background noise only.

``generate_study_set`` writes ``manifest.csv`` (``path,label``; paths relative to the manifest)
and ``phi.json`` (every planted PHI value, per file and overall) next to it, so de-id tests can
scan the output *bytes* for each original value. :func:`phi_values` computes the same set from any
dataset (read back from disk or in memory).
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import UID, ExplicitVRLittleEndian

from securetrain.io.atomic import atomic_write_bytes

__all__ = [
    "SOP_CLASSES",
    "PRIVATE_CREATOR",
    "PHI_TEXT_KEYWORDS",
    "SyntheticPatient",
    "generate_study_set",
    "generate_one",
    "phi_values",
    "phi_report",
    "load_phi_manifest",
]

SOP_CLASSES: dict[str, str] = {
    "CT": "1.2.840.10008.5.1.4.1.1.2",  # CT Image Storage
    "MR": "1.2.840.10008.5.1.4.1.1.4",  # MR Image Storage
    "US": "1.2.840.10008.5.1.4.1.1.6.1",  # Ultrasound Image Storage
    "SC": "1.2.840.10008.5.1.4.1.1.7",  # Secondary Capture Image Storage
}
_DETACHED_STUDY = "1.2.840.10008.3.1.2.3.1"  # Detached Study Management SOP class (used in ReferencedStudySequence)

PRIVATE_CREATOR = "ACME HOSPITAL PACS 1.0"
PRIVATE_GROUP = 0x0011
_IMPLEMENTATION_UID = "2.25.240912202411120000000000000000000001"

# Tags whose *text* values are PHI in what we generate (identifiers, names, places, free text).
PHI_TEXT_KEYWORDS: frozenset[str] = frozenset(
    {
        "PatientName", "PatientID", "IssuerOfPatientID", "OtherPatientIDs", "OtherPatientNames",
        "PatientBirthName", "PatientMotherBirthName", "PatientAddress", "PatientTelephoneNumbers",
        "PatientComments", "AdditionalPatientHistory", "MedicalRecordLocator", "Occupation",
        "InstitutionName", "InstitutionAddress", "InstitutionalDepartmentName",
        "ReferringPhysicianName", "ReferringPhysicianAddress", "ReferringPhysicianTelephoneNumbers",
        "PerformingPhysicianName", "NameOfPhysiciansReadingStudy", "OperatorsName", "RequestingPhysician",
        "PhysiciansOfRecord", "StationName", "DeviceSerialNumber", "AccessionNumber", "StudyID",
        "StudyDescription", "SeriesDescription", "ImageComments", "RequestedProcedureID",
        "RequestedProcedureDescription", "ScheduledProcedureStepID", "ScheduledProcedureStepDescription",
        "PersonName", "TextValue", "OverlayDescription", "OverlayLabel", "ProtocolName",
        "PerformedProcedureStepID", "PerformedProcedureStepDescription", "FillerOrderNumberImagingServiceRequest",
        "PlacerOrderNumberImagingServiceRequest",
    }
)
_DATE_VRS = frozenset({"DA", "DT", "TM"})
_TEXT_VRS = frozenset({"AE", "AS", "CS", "DS", "IS", "LO", "LT", "PN", "SH", "ST", "UC", "UT", "DA", "DT", "TM"})

_FIRST = ["ERIKA", "JOHN", "AMELIA", "RAJESH", "SOFIA", "HIROSHI", "OLUWASEUN", "MARGARETHE", "DMITRI",
          "CLEMENTINE", "BARNABY", "PERPETUA", "IGNATIUS", "WINIFRED", "THADDEUS", "OTTILIE"]
_LAST = ["MUSTERMANN", "QUARTERMAINE", "VANDERBILT", "OKONKWO", "FITZWILLIAM", "TAKAHASHI", "ABERNATHY",
         "GRUNDLEHNER", "PAPADOPOULOS", "KOWALCZYK", "LINDQVIST", "HAWTHORNE", "DELACROIX", "MACALLISTER"]
_STREETS = ["Larkspur Lane", "Juniper Crescent", "Old Mill Road", "Harbourview Terrace", "Quince Alley"]
_CITIES = ["Springfield", "Rivendell Falls", "Bramblebury", "Port Calloway", "Westerhaven"]
_HOSPITALS = ["St. Hildegard Memorial Hospital", "Bramblebury General Infirmary", "Calloway Heart Institute"]
_BODY = {"CT": ["CHEST", "ABDOMEN", "HEAD"], "MR": ["BRAIN", "KNEE", "SPINE"], "US": ["ABDOMEN"], "SC": ["CHEST"]}


def _display(pn: str) -> str:
    """'DOE^JOHN' -> 'John Doe': how names appear inside free text."""
    parts = [p for p in pn.split("^") if p]
    if len(parts) >= 2:
        return f"{parts[1].title()} {parts[0].title()}"
    return pn.title()


@dataclass(frozen=True)
class SyntheticPatient:
    """One fake patient; every string here is PHI-shaped and planted somewhere in the files."""

    index: int
    name: str
    patient_id: str
    other_id: str
    birth_date: str
    sex: str
    age: str
    address: str
    phone: str
    mother_name: str
    occupation: str
    referring: str
    operator: str
    performing: str
    reader: str
    institution: str
    institution_address: str
    station: str
    device_serial: str
    date_shift_days: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def make(cls, rnd: random.Random, index: int) -> SyntheticPatient:
        def person() -> str:
            return f"{rnd.choice(_LAST)}^{rnd.choice(_FIRST)}^{rnd.choice(_FIRST)[0]}"

        year = rnd.randint(1935, 2005)
        birth = f"{year:04d}{rnd.randint(1, 12):02d}{rnd.randint(1, 28):02d}"
        age = 2024 - year
        hospital = rnd.choice(_HOSPITALS)
        return cls(
            index=index,
            name=f"{rnd.choice(_LAST)}^{rnd.choice(_FIRST)}",
            patient_id=f"MRN{rnd.randint(10**7, 10**8 - 1)}",
            other_id=f"NHS{rnd.randint(10**9, 10**10 - 1)}",
            birth_date=birth,
            sex=rnd.choice(["M", "F", "O"]),
            age=f"{age:03d}Y",
            address=f"{rnd.randint(10, 9999)} {rnd.choice(_STREETS)}^^{rnd.choice(_CITIES)}^ZZ^{rnd.randint(10000, 99999)}",
            phone=f"+1-555-{rnd.randint(100, 999)}-{rnd.randint(1000, 9999)}",
            mother_name=f"{rnd.choice(_LAST)}^{rnd.choice(_FIRST)}",
            occupation=rnd.choice(["Lamplighter", "Cartographer", "Beekeeper", "Clockmaker"]),
            referring=person(),
            operator=person(),
            performing=person(),
            reader=person(),
            institution=hospital,
            institution_address=f"{rnd.randint(1, 500)} Infirmary Way, {rnd.choice(_CITIES)}",
            station=f"ACME-{rnd.choice(['CT', 'MR', 'US'])}{rnd.randint(100, 999)}-RM{rnd.randint(1, 40)}",
            device_serial=f"SN{rnd.randint(10**8, 10**9 - 1)}",
        )


def _uid(seed: int, *parts: object) -> UID:
    # 2.25.<uuid5-int> (ISO/IEC 9834-8) from (seed, parts): deterministic, collision-free in practice.
    # (pydicom's generate_uid(prefix=None) ignores entropy_srcs and is random, so it cannot be used.)
    name = "|".join(["securetrain-synthetic", str(seed), *map(str, parts)])
    return UID(f"2.25.{uuid.uuid5(uuid.NAMESPACE_OID, name).int}")


def _date(rnd: random.Random, year_lo: int = 2015, year_hi: int = 2023) -> str:
    return f"{rnd.randint(year_lo, year_hi):04d}{rnd.randint(1, 12):02d}{rnd.randint(1, 28):02d}"


def _time(rnd: random.Random) -> str:
    return f"{rnd.randint(7, 19):02d}{rnd.randint(0, 59):02d}{rnd.randint(0, 59):02d}.{rnd.randint(0, 999999):06d}"


def _pixels(
    rng: np.random.Generator, size: int, label: int, *, burned_in: bool, contrast: float = 1800.0
) -> np.ndarray:
    """uint16 image (12 bits stored); label 1 adds a blob of peak ``contrast`` at a random location.

    The background noise has sigma 60, so the default contrast is trivially visible; a few hundred
    makes a learning problem worth a CNN."""
    img = rng.normal(800.0, 60.0, size=(size, size))
    if label:
        radius = max(1.5, size / 10)
        cy, cx = rng.uniform(radius, size - radius, size=2)
        yy, xx = np.mgrid[0:size, 0:size]
        img += contrast * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * radius**2))
    if burned_in:
        # Simulated burned-in text: a saturated strip of "glyphs" along the top rows.
        rows = max(2, size // 12)
        glyphs = rng.integers(0, 2, size=(rows, size)).astype(bool)
        img[:rows][glyphs] = 4095
    return np.clip(img, 0, 4095).astype(np.uint16)


def _overlay(rng: np.random.Generator, size: int) -> bytes:
    """1-bit overlay plane (packed little-endian bit order, padded to even length), e.g. an annotation box."""
    plane = np.zeros((size, size), dtype=np.uint8)
    a, b = sorted(rng.integers(1, size - 1, size=2))
    plane[a, a:b + 1] = plane[b, a:b + 1] = plane[a:b + 1, a] = plane[a:b + 1, b] = 1
    packed = np.packbits(plane.ravel(), bitorder="little").tobytes()
    return packed + (b"\x00" if len(packed) % 2 else b"")


def _build(
    *,
    seed: int,
    patient: SyntheticPatient,
    study_index: int,
    modality: str,
    image_index: int,
    n_images: int,
    label: int,
    image_size: int,
    burned_in: bool,
    contrast: float = 1800.0,
    study_date: str,
    study_time: str,
    accession: str,
    study_id: str,
    rnd: random.Random,
    rng: np.random.Generator,
) -> Dataset:
    p, s, i = patient.index, study_index, image_index
    study_uid = _uid(seed, "study", p, s)
    series_uid = _uid(seed, "series", p, s, modality)
    sop_uid = _uid(seed, "sop", p, s, modality, i)
    frame_uid = _uid(seed, "frame", p, s)
    sop_class = SOP_CLASSES[modality]
    body = rnd.choice(_BODY[modality])
    who = _display(patient.name)

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = UID(sop_class)
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = UID(_IMPLEMENTATION_UID)
    meta.ImplementationVersionName = "SECURETRAIN_SYN1"
    meta.SourceApplicationEntityTitle = patient.station[:16]

    ds = Dataset()
    ds.file_meta = meta
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"] if modality in {"CT", "MR"} else ["DERIVED", "SECONDARY"]
    ds.SOPClassUID = sop_class
    ds.SOPInstanceUID = sop_uid
    ds.InstanceCreationDate = study_date
    ds.InstanceCreationTime = study_time
    ds.StudyDate = ds.SeriesDate = ds.AcquisitionDate = ds.ContentDate = study_date
    ds.StudyTime = study_time
    ds.SeriesTime = ds.AcquisitionTime = ds.ContentTime = _time(rnd)
    ds.AcquisitionDateTime = f"{study_date}{ds.AcquisitionTime}"
    ds.AccessionNumber = accession
    ds.Modality = modality
    ds.Manufacturer = "ACME Imaging"
    ds.ManufacturerModelName = f"Synthetica {modality}-9000"
    ds.InstitutionName = patient.institution
    ds.InstitutionAddress = patient.institution_address
    ds.InstitutionalDepartmentName = f"Radiology - {patient.institution}"
    ds.ReferringPhysicianName = patient.referring
    ds.ReferringPhysicianAddress = patient.institution_address
    ds.ReferringPhysicianTelephoneNumbers = f"+1-555-{rnd.randint(100, 999)}-{rnd.randint(1000, 9999)}"
    ds.PhysiciansOfRecord = patient.referring
    ds.PerformingPhysicianName = patient.performing
    ds.NameOfPhysiciansReadingStudy = patient.reader
    ds.OperatorsName = patient.operator
    ds.StationName = patient.station
    ds.StudyDescription = f"{modality} {body} follow-up for {who}"
    ds.SeriesDescription = f"{body} series, tech {_display(patient.operator)}"
    ds.ProtocolName = f"{body} protocol ({who})"
    ds.PatientName = patient.name
    ds.PatientID = patient.patient_id
    ds.IssuerOfPatientID = patient.institution
    ds.PatientBirthDate = patient.birth_date
    ds.PatientSex = patient.sex
    ds.PatientAge = patient.age
    ds.PatientWeight = f"{rnd.uniform(45, 120):.1f}"
    ds.OtherPatientIDs = patient.other_id
    ds.OtherPatientNames = patient.mother_name.split("^")[0] + "^" + patient.name.split("^")[1]
    ds.PatientBirthName = patient.name.split("^")[0] + "^" + patient.name.split("^")[1]
    ds.PatientMotherBirthName = patient.mother_name
    ds.PatientAddress = patient.address
    ds.PatientTelephoneNumbers = patient.phone
    ds.Occupation = patient.occupation
    ds.MedicalRecordLocator = f"Chart shelf {patient.patient_id}"
    ds.AdditionalPatientHistory = f"{who} reports pain since {patient.birth_date[:4]}; call {patient.phone}"
    ds.PatientComments = f"Contact {_display(patient.mother_name)} (mother) at {patient.phone}"
    ds.DeviceSerialNumber = patient.device_serial
    ds.SoftwareVersions = "SYN 1.0"
    ds.StudyInstanceUID = study_uid
    ds.SeriesInstanceUID = series_uid
    ds.FrameOfReferenceUID = frame_uid
    ds.StudyID = study_id
    ds.SeriesNumber = 1
    ds.InstanceNumber = i + 1
    ds.ImageComments = f"pt {who}, {patient.patient_id}, DOB {patient.birth_date}"
    ds.BodyPartExamined = body
    ds.BurnedInAnnotation = "YES" if burned_in else "NO"

    # Links to sibling images: UIDs that a de-id must remap consistently.
    if n_images > 1:
        ref = Dataset()
        ref.ReferencedSOPClassUID = sop_class
        ref.ReferencedSOPInstanceUID = _uid(seed, "sop", p, s, modality, (i + 1) % n_images)
        ds.ReferencedImageSequence = DicomSequence([ref])
        src = Dataset()
        src.ReferencedSOPClassUID = sop_class
        src.ReferencedSOPInstanceUID = _uid(seed, "sop", p, s, modality, (i - 1) % n_images)
        ds.SourceImageSequence = DicomSequence([src])

    # Depth 1-3: request attributes -> referenced study -> content item naming the patient.
    person_item = Dataset()
    person_item.ValueType = "PNAME"
    person_item.PersonName = patient.name
    person_item.TextValue = f"Requested by {_display(patient.referring)} for {who}"
    ref_study = Dataset()
    ref_study.ReferencedSOPClassUID = _DETACHED_STUDY
    ref_study.ReferencedSOPInstanceUID = study_uid
    ref_study.ContentSequence = DicomSequence([person_item])  # depth 3
    req = Dataset()
    req.RequestedProcedureID = f"RP{accession}"
    req.RequestedProcedureDescription = f"{modality} {body} for {who}"
    req.ScheduledProcedureStepID = f"SPS{accession}"
    req.ScheduledProcedureStepDescription = f"Scan {who} ({patient.patient_id})"
    req.AccessionNumber = accession
    req.ReferencedStudySequence = DicomSequence([ref_study])  # depth 2
    ds.RequestAttributesSequence = DicomSequence([req])  # depth 1
    ds.PerformedProcedureStepID = f"PPS{accession}"
    ds.PerformedProcedureStepDescription = f"{body} done by {_display(patient.performing)}"
    ds.RequestingPhysician = patient.referring

    top_ref_study = Dataset()
    top_ref_study.ReferencedSOPClassUID = _DETACHED_STUDY
    top_ref_study.ReferencedSOPInstanceUID = study_uid
    ds.ReferencedStudySequence = DicomSequence([top_ref_study])

    other_ids = Dataset()
    other_ids.PatientID = patient.other_id
    other_ids.IssuerOfPatientID = "NHS"
    ds.OtherPatientIDsSequence = DicomSequence([other_ids])

    # Private creator block with names/IDs and a private sequence nesting PatientName at depth 3.
    block = ds.private_block(PRIVATE_GROUP, PRIVATE_CREATOR, create=True)
    block.add_new(0x01, "PN", patient.name)
    block.add_new(0x02, "LO", patient.patient_id)
    block.add_new(0x03, "LO", f"Billing account {patient.other_id} / {patient.phone}")
    block.add_new(0x04, "DA", patient.birth_date)
    deep = Dataset()
    deep.PatientName = patient.name
    deep.PatientID = patient.patient_id
    deep.PatientBirthDate = patient.birth_date
    inner = Dataset()
    inner_block = inner.private_block(PRIVATE_GROUP, PRIVATE_CREATOR, create=True)
    inner_block.add_new(0x10, "LO", f"Worklist entry for {who}")
    inner_block.add_new(0x11, "SQ", DicomSequence([deep]))  # depth 2 -> deep is depth 3
    block.add_new(0x05, "SQ", DicomSequence([inner]))  # depth 1

    # Image pixel module.
    pixels = _pixels(rng, image_size, label, burned_in=burned_in, contrast=contrast)
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows = ds.Columns = image_size
    ds.BitsAllocated = 16
    ds.BitsStored = 12
    ds.HighBit = 11
    ds.PixelRepresentation = 0
    ds.PixelSpacing = ["0.7", "0.7"]
    if modality == "CT":
        ds.RescaleIntercept = "-1024"
        ds.RescaleSlope = "1"
        ds.KVP = "120"
    ds.PixelData = pixels.tobytes()
    ds["PixelData"].VR = "OW"

    # Overlay plane (group 6000): a box annotation plus a description naming the patient.
    ds.add_new(0x60000010, "US", image_size)  # OverlayRows
    ds.add_new(0x60000011, "US", image_size)  # OverlayColumns
    ds.add_new(0x60000022, "LO", f"Marked by {_display(patient.reader)} for {who}")  # OverlayDescription
    ds.add_new(0x60000040, "CS", "G")  # OverlayType: graphics
    ds.add_new(0x60000050, "SS", [1, 1])  # OverlayOrigin
    ds.add_new(0x60000100, "US", 1)  # OverlayBitsAllocated
    ds.add_new(0x60000102, "US", 0)  # OverlayBitPosition
    ds.add_new(0x60001500, "LO", f"{patient.patient_id} annotation")  # OverlayLabel
    ds.add_new(0x60003000, "OW", _overlay(rng, image_size))  # OverlayData
    return ds


def _walk(ds: Dataset) -> Iterable:
    for elem in ds:
        if elem.VR == "SQ":
            yield elem
            for item in elem.value or ():
                yield from _walk(item)
        else:
            yield elem


def _strings(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)) or type(value).__name__ == "MultiValue":
        out: list[str] = []
        for v in cast(Iterable[Any], value):
            out.extend(_strings(v))
        return out
    text = str(value).strip()
    return [text] if text else []


def phi_report(ds: Dataset) -> dict[str, list[str]]:
    """Planted PHI in ``ds`` by category: ``text`` (names, ids, places, free text), ``dates``
    (DA/DT/TM values), ``uids`` (instance UIDs, not well-known SOP class/transfer syntax UIDs).

    Walks nested sequences and private blocks. Names in ``LAST^FIRST`` form are also listed in the
    ``First Last`` display form, since that is how they appear inside free text.
    """
    text: set[str] = set()
    dates: set[str] = set()
    uids: set[str] = set()
    for elem in _walk(ds):
        if elem.VR == "SQ" or elem.tag.is_private_creator:
            continue
        if elem.VR == "UI":
            uids.update(u for u in _strings(elem.value) if not u.startswith("1.2.840.10008."))
            continue
        if elem.VR not in _TEXT_VRS:
            continue
        values = _strings(elem.value)
        if elem.VR in _DATE_VRS:
            dates.update(values)
        elif elem.tag.is_private or elem.keyword in PHI_TEXT_KEYWORDS or elem.tag.group & 0xFF00 == 0x6000 and elem.VR == "LO":
            text.update(values)
            if elem.VR == "PN":
                text.update(_display(v) for v in values)
    # Values shorter than 4 characters (e.g. sex "M") cannot be scanned for meaningfully.
    text = {t for t in text if len(t) >= 4}
    return {"text": sorted(text), "dates": sorted(dates), "uids": sorted(uids)}


def phi_values(ds: Dataset, *, include_dates: bool = True, include_uids: bool = True) -> set[str]:
    """Every planted PHI string in ``ds`` (see :func:`phi_report`), for byte-scanning de-id output."""
    rep = phi_report(ds)
    out = set(rep["text"])
    if include_dates:
        out.update(rep["dates"])
    if include_uids:
        out.update(rep["uids"])
    return out


def _to_bytes(ds: Dataset) -> bytes:
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


def generate_one(
    *,
    seed: int = 0,
    modality: str = "CT",
    label: int = 1,
    image_size: int = 32,
    burned_in: bool = False,
    path: str | os.PathLike[str] | None = None,
) -> Dataset:
    """One synthetic image (with file meta) for a fresh fake patient; written to ``path`` if given."""
    if modality not in SOP_CLASSES:
        raise ValueError(f"unsupported modality {modality!r}; choose from {sorted(SOP_CLASSES)}")
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    patient = SyntheticPatient.make(rnd, 0)
    acc = f"ACC{rnd.randint(10**6, 10**7 - 1)}"
    ds = _build(
        seed=seed, patient=patient, study_index=0, modality=modality, image_index=0, n_images=1,
        label=int(label), image_size=image_size, burned_in=burned_in, study_date=_date(rnd),
        study_time=_time(rnd), accession=acc, study_id=f"ST{rnd.randint(1000, 9999)}", rnd=rnd, rng=rng,
    )
    if path is not None:
        atomic_write_bytes(path, _to_bytes(ds), mode=0o644)
    return ds


def generate_study_set(
    out_dir: str | os.PathLike[str],
    *,
    n_patients: int = 4,
    studies_per_patient: int = 2,
    images_per_series: int = 4,
    image_size: int = 32,
    seed: int = 0,
    modalities: Sequence[str] = ("CT", "MR"),
    include_burned_in: bool = False,
    blob_contrast: float = 1800.0,
) -> Path:
    """Write a synthetic study set under ``out_dir``; return the path of ``manifest.csv``.

    Layout: ``pNNN/stNN/seNN/imNNN.dcm`` (directory names carry no PHI). Each study has one series,
    its modality cycling through ``modalities``. Labels are balanced-ish random 0/1 per image.
    With ``include_burned_in`` each patient also gets one US and one SC image with
    ``BurnedInAnnotation=YES`` and simulated text pixels (a de-id pipeline should refuse or scrub them).
    ``phi.json`` next to the manifest lists the PHI planted per file (``files``) and in total (``all``).
    ``blob_contrast`` is the peak of the label-1 blob over noise of sigma 60 (lower = harder).
    Same arguments -> byte-identical files.
    """
    if n_patients < 1 or studies_per_patient < 1 or images_per_series < 1:
        raise ValueError("n_patients, studies_per_patient and images_per_series must be >= 1")
    if image_size < 8:
        raise ValueError("image_size must be >= 8")
    bad = [m for m in modalities if m not in SOP_CLASSES]
    if not modalities or bad:
        raise ValueError(f"unsupported modalities {bad}; choose from {sorted(SOP_CLASSES)}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    rows: list[tuple[str, int]] = []
    per_file: dict[str, dict[str, list[str]]] = {}
    totals: dict[str, set[str]] = {"text": set(), "dates": set(), "uids": set()}

    def emit(rel: str, ds: Dataset, label: int) -> None:
        atomic_write_bytes(root / rel, _to_bytes(ds), mode=0o644)
        rep = phi_report(ds)
        per_file[rel] = rep
        for k, v in rep.items():
            totals[k].update(v)
        rows.append((rel, label))

    used_names: set[str] = set()
    for p in range(n_patients):
        patient = SyntheticPatient.make(rnd, p)
        while patient.name in used_names:  # distinct names keep per-patient pseudonym tests meaningful
            patient = SyntheticPatient.make(rnd, p)
        used_names.add(patient.name)
        series_plan: list[tuple[str, int, bool]] = [
            (modalities[s % len(modalities)], images_per_series, False) for s in range(studies_per_patient)
        ]
        if include_burned_in:
            series_plan += [("US", 1, True), ("SC", 1, True)]
        for s, (modality, n_images, burned) in enumerate(series_plan):
            study_date = _date(rnd)
            study_time = _time(rnd)
            accession = f"ACC{rnd.randint(10**6, 10**7 - 1)}"
            study_id = f"ST{rnd.randint(1000, 9999)}"
            for i in range(n_images):
                label = int(rnd.random() < 0.5)
                ds = _build(
                    seed=seed, patient=patient, study_index=s, modality=modality, image_index=i,
                    n_images=n_images, label=label, image_size=image_size, burned_in=burned, contrast=blob_contrast,
                    study_date=study_date, study_time=study_time, accession=accession, study_id=study_id,
                    rnd=rnd, rng=rng,
                )
                emit(f"p{p:03d}/st{s:02d}/se00/im{i:03d}.dcm", ds, label)

    manifest = root / "manifest.csv"
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["path", "label"])
    writer.writerows(rows)
    atomic_write_bytes(manifest, buf.getvalue().encode(), mode=0o644)
    phi_doc = {
        "seed": seed,
        "files": per_file,
        "all": {k: sorted(v) for k, v in totals.items()},
    }
    atomic_write_bytes(root / "phi.json", json.dumps(phi_doc, indent=1, sort_keys=True).encode(), mode=0o644)
    return manifest


def load_phi_manifest(manifest: str | os.PathLike[str]) -> dict:
    """Read the ``phi.json`` written next to ``manifest`` by :func:`generate_study_set`."""
    return json.loads((Path(manifest).parent / "phi.json").read_text(encoding="utf-8"))

"""Regression tests for the defects of issue 15 (each failed before its fix)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pydicom
import pytest
from dicom_fixtures import POLICY_DIR, SECRET, make_dataset, roundtrip
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian, generate_uid

from securetrain.masking.dicom.dates import shift_da, shift_dt
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset, read_dicom
from securetrain.masking.dicom.errors import MissingPatientIdentityError, UnreadableDicomError
from securetrain.masking.dicom.policy import load_policy

BASIC = POLICY_DIR / "dicom-basic.yaml"
LONGITUDINAL = POLICY_DIR / "dicom-research-longitudinal.yaml"


def _deid(policy: Path = BASIC, **update: object) -> Deidentifier:
    pol = load_policy(policy)
    if update:
        pol = load_policy(data={**pol.model_dump(mode="json"), **update})
    return Deidentifier(pol, SECRET)


def _image(**kw: object) -> Dataset:
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    ds.SOPInstanceUID = generate_uid()
    ds.StudyInstanceUID = generate_uid()
    ds.Modality = "CT"
    ds.PatientID = "PID-4711"
    for k, v in kw.items():
        setattr(ds, k, v)
    return ds


# ------------------------------------------------------------------ unlisted public text attributes
def test_unlisted_public_text_is_removed_by_default() -> None:
    ds = _image(PatientName="DOE^JANE")
    ds.add_new(0x30040006, "LO", "dose note for PID-4711 by Dr Who")  # Dose Comment: not in Table E.1-1
    ds.add_new(0x00181030 + 0, "LO", "PROTO")  # Protocol Name: listed (X/D), for contrast
    ds.add_new(0x00FE0010, "LO", "unknown-to-the-dictionary PID-4711")  # not in the data dictionary
    ds.Manufacturer = "ACME"  # safe-listed: kept
    out, _ = _deid().deidentify_dataset(roundtrip(ds))
    assert 0x30040006 not in out and 0x00FE0010 not in out
    assert out.Manufacturer == "ACME"
    assert b"PID-4711" not in encode_dataset(out)


def test_unlisted_public_text_kept_when_the_policy_lists_it_and_still_scrubbed() -> None:
    ds = _image(PatientName="DOE^JANE")
    ds.add_new(0x30040006, "LO", "dose note for PID-4711")
    deid = _deid(overrides={"DoseComment": "K"})
    out, _ = deid.deidentify_dataset(roundtrip(ds))
    assert out[0x30040006].value == "dose note for XXXXXXXX"


# ------------------------------------------------------------------ name scrubbing
def test_short_name_parts_are_scrubbed_at_word_boundaries() -> None:
    ds = _image(PatientName="LI^WEI", SeriesDescription="Li Wei chest; Context view; Liver Weight")
    ds.StudyID = "TEXT"  # a removed value that is also part of the word "Context"
    out, _ = _deid(LONGITUDINAL).deidentify_dataset(roundtrip(ds))
    desc = out.SeriesDescription
    assert "Li Wei" not in desc and desc.startswith("XX") and " chest;" in desc
    assert "Context view" in desc  # whole words only: no "ConXXXX"
    assert "Liver Weight" in desc  # "Li"/"Wei" inside longer words are not names


@pytest.mark.parametrize(
    "charset,name,history,leaked",
    [
        ("ISO_IR 192", "Yamada^Tarou=山田^太郎=やまだ^たろう", "山田太郎さん, やまだ たろう, Yamada", ("山田", "太郎", "やまだ", "Yamada")),
        ("ISO_IR 192", "Hong^Gildong=홍^길동", "홍길동 환자 (Hong Gildong)", ("홍길동", "길동", "Hong", "Gildong")),
        (["", "ISO 2022 IR 87"], "Yamada^Tarou=山田^太郎", "山田太郎 follow-up", ("山田", "太郎")),
    ],
)
def test_cjk_names_are_scrubbed_from_retained_text(charset: object, name: str, history: str, leaked: tuple) -> None:
    ds = _image(SpecificCharacterSet=charset, PatientName=name, AdditionalPatientHistory=history)
    out, _ = _deid(LONGITUDINAL).deidentify_dataset(roundtrip(ds))
    back = pydicom.dcmread(io.BytesIO(encode_dataset(out)))
    text = str(back.AdditionalPatientHistory)
    for part in leaked:
        assert part not in text


# ------------------------------------------------------------------ VR conformance of written values
def test_written_values_fit_their_vr_with_a_long_policy_name() -> None:
    deid = _deid(name="a-very-long-policy-name-for-the-radiology-research-cohort-2026")
    out, _ = deid.deidentify_dataset(roundtrip(make_dataset()))
    blob = encode_dataset(out)
    from pydicom.valuerep import validate_value

    back = pydicom.dcmread(io.BytesIO(blob))
    assert all(len(v) <= 64 for v in back.DeidentificationMethod)
    assert any("sha256:" + deid.policy.digest[:16] in v for v in back.DeidentificationMethod)
    for elem in back.iterall():  # every value we wrote validates strictly
        if elem.VR in ("LO", "SH", "PN", "CS", "DA", "DT", "TM", "UI", "AS", "IS", "DS") and elem.value not in (None, ""):
            values = elem.value if isinstance(elem.value, pydicom.multival.MultiValue) else [elem.value]
            for v in values:
                validate_value(elem.VR, v, pydicom.config.RAISE)


def test_single_valued_iso_2022_ir_87_file_is_written() -> None:
    ds = _image(SpecificCharacterSet="ISO 2022 IR 87", PatientName="山田^太郎", ReferringPhysicianName="鈴木^花子")
    original = roundtrip(ds)
    out, report = _deid().deidentify_dataset(original)
    back = pydicom.dcmread(io.BytesIO(encode_dataset(out)))
    assert str(back.PatientName) == report.patient_pseudonym
    assert "山田" not in str(back.PatientName)


# ------------------------------------------------------------------ reading files without the preamble
def _raw_dataset_bytes(ds: Dataset, implicit: bool = True) -> bytes:
    buf = io.BytesIO()
    del ds.file_meta
    ds.is_implicit_VR, ds.is_little_endian = implicit, True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pydicom.dcmwrite(buf, ds, enforce_file_format=False)
    assert buf.getvalue()[128:132] != b"DICM"
    return buf.getvalue()


def test_files_without_preamble_are_read_and_deidentified(tmp_path: Path) -> None:
    from pydicom.data import get_testdata_file

    # a stripped, DICOMDIR-referenced style image: raw implicit VR data set, no meta
    ds = _image(PatientName="DOE^JANE", Rows=2, Columns=2, BitsAllocated=8, BitsStored=8, HighBit=7,
                SamplesPerPixel=1, PhotometricInterpretation="MONOCHROME2", PixelRepresentation=0,
                PixelData=bytes(4))
    src = tmp_path / "IM000001"
    src.write_bytes(_raw_dataset_bytes(ds))
    report = _deid().deidentify_file(src, tmp_path / "out.dcm")
    back = pydicom.dcmread(tmp_path / "out.dcm")
    assert back.file_meta.TransferSyntaxUID == ImplicitVRLittleEndian
    assert back.PatientID == report.patient_pseudonym
    # pydicom's own test file without a preamble
    rt = Path(get_testdata_file("rtstruct.dcm"))
    assert rt.read_bytes()[128:132] != b"DICM"
    _deid().deidentify_file(rt, tmp_path / "rt.dcm")
    assert pydicom.dcmread(tmp_path / "rt.dcm").PatientIdentityRemoved == "YES"


@pytest.mark.parametrize("content", [b"", b"hello, this is not DICOM\n" * 40, bytes(range(256)) * 8])
def test_truly_unreadable_files_are_refused_with_a_reason(tmp_path: Path, content: bytes) -> None:
    src = tmp_path / "x.dcm"
    src.write_bytes(content)
    with pytest.raises(UnreadableDicomError, match=r"x\.dcm: .{10,}"):
        read_dicom(src)
    assert not (tmp_path / "out.dcm").exists()


# ------------------------------------------------------------------ dates
@pytest.mark.parametrize("days", [1, 100, 365, -10, -400, 3650])
def test_year_and_month_precision_dates_always_move(days: int) -> None:
    assert shift_da("2020", days) not in (None, "2020")
    assert shift_da("202006", days) not in (None, "202006")
    assert len(shift_da("2020", days)) == 4 and len(shift_da("202006", days)) == 6
    assert (int(shift_da("2020", days)) > 2020) == (days > 0)


def test_dt_range_keeps_both_ends() -> None:
    assert shift_dt("20200101120000-20200301080000", 10) == "20200111120000-20200311080000"
    assert shift_dt("20200101-", 1) == "20200102-"
    assert shift_dt("-20200101", 1) == "-20200102"
    assert shift_dt("20200101120000+0100", 1) == "20200102120000"  # offset dropped, not a range
    assert shift_dt("2020-2021", 400) == "2021-2022"


def test_dt_range_is_shifted_in_the_dataset_not_removed() -> None:
    ds = _image(PatientName="DOE^JANE", AcquisitionDateTime="20200101120000-20200101130000")
    out, _ = _deid(LONGITUDINAL).deidentify_dataset(roundtrip(ds))
    low, high = str(out.AcquisitionDateTime).split("-")
    assert len(low) == len(high) == 14 and low[8:] == "120000" and high[8:] == "130000"
    assert low != "20200101120000"


# ------------------------------------------------------------------ DicomDataset
def _write_ct(path: Path, **kw: object) -> None:
    ds = _image(PatientName="DOE^JANE", Rows=4, Columns=4, BitsAllocated=16, BitsStored=16, HighBit=15,
                SamplesPerPixel=1, PhotometricInterpretation="MONOCHROME2", PixelRepresentation=0,
                PixelData=np.arange(16, dtype=np.uint16).tobytes(), **kw)
    ds.BurnedInAnnotation = "NO"
    path.parent.mkdir(parents=True, exist_ok=True)
    pydicom.dcmwrite(path, ds, enforce_file_format=True)


def test_dataset_quarantines_multivalued_rescale_slope_instead_of_crashing(tmp_path: Path) -> None:
    from securetrain.masking.dicom.dataset import DicomDataset

    for i in range(4):
        _write_ct(tmp_path / "in" / f"{i}.dcm")
    bad = tmp_path / "in" / "1.dcm"
    ds = pydicom.dcmread(bad)
    ds.RescaleSlope = [1, 2]
    ds.save_as(bad)
    data = DicomDataset(tmp_path / "in", BASIC, SECRET, size=4)
    assert len(data) == 3
    report = data.quarantine_report()
    assert [q["path"] for q in report] == ["1.dcm"] and "multi-valued" in report[0]["reason"]
    # also when the value only turns bad after indexing, in DataLoader worker processes
    good = tmp_path / "in" / "2.dcm"
    ds = pydicom.dcmread(good)
    ds.RescaleSlope = [3, 4]
    ds.save_as(good)
    batches = list(data.dataloader(batch_size=2, num_workers=2))
    assert sum(b["pixels"].shape[0] for b in batches if b is not None) == 2


def test_dataset_caches_the_deidentified_header(tmp_path: Path) -> None:
    from securetrain.masking.dicom.dataset import DicomDataset

    for i in range(3):
        _write_ct(tmp_path / "in" / f"{i}.dcm")
    data = DicomDataset(tmp_path / "in", BASIC, SECRET, size=4)
    first = [data[i] for i in range(3)]
    calls = []
    engine = data._deidentifier()
    original = engine.deidentify_dataset
    engine.deidentify_dataset = lambda *a, **k: (calls.append(1), original(*a, **k))[1]  # type: ignore[method-assign]
    second = [data[i] for i in range(3)]
    assert not calls  # later epochs skip the de-identification pass
    for a, b in zip(first, second, strict=True):
        assert a["meta"] == b["meta"] and bool((a["pixels"] == b["pixels"]).all())


def test_stripped_dicomdir_referenced_images_are_written(tmp_path: Path) -> None:
    """pydicom's dicomdirtests images: header-only CT objects without image attributes, read by a
    DICOMDIR. They are valid data sets (not truncated) and must be de-identified, not refused."""
    from pydicom.data import get_testdata_files

    files = [f for f in get_testdata_files() if Path(f).name.startswith("IM0000") and Path(f).is_file()][:5]
    assert files
    for i, f in enumerate(files):
        out = tmp_path / f"{i}.dcm"
        report = _deid().deidentify_file(f, out)
        back = pydicom.dcmread(out)
        assert back.PatientIdentityRemoved == "YES" and back.SOPInstanceUID == report.sop_instance_uid


def test_truncated_files_are_refused_with_the_element_that_ends_early(tmp_path: Path) -> None:
    full = encode_dataset(make_dataset())
    for n in (500, 700, 1000, len(full) - 10):
        src = tmp_path / f"cut{n}.dcm"
        src.write_bytes(full[:n])
        with pytest.raises(UnreadableDicomError, match="truncated"):
            _deid().deidentify_file(src, tmp_path / "out.dcm")
    assert not (tmp_path / "out.dcm").exists()


@pytest.mark.parametrize("policy", [BASIC, LONGITUDINAL])
def test_every_specific_character_set_file_is_written_without_its_names(policy: Path) -> None:
    """pydicom's character-set files (Latin-1, Greek, Cyrillic, Arabic, Hebrew, Japanese ISO 2022
    IR 87/13/159, Korean, Chinese, UTF-8, GB18030, multi-valued sets): each is written, re-read,
    and no name component of >= 2 characters survives in any text value."""
    from pydicom.data import get_charset_files

    deid = _deid(policy)
    files = [f for f in get_charset_files() if f.endswith(".dcm")]
    assert len(files) >= 10
    for f in files:
        original = read_dicom(f)
        ds = read_dicom(f)
        ds.BurnedInAnnotation = "NO"  # OT images: this test is about the header
        if "PatientID" not in original and "PatientName" not in original:  # chrSQEncoding*: names only nested
            with pytest.raises(MissingPatientIdentityError):  # no patient identity: refused as it is
                deid.deidentify_dataset(read_dicom(f))
            ds.PatientID = "CHARSET-TEST-ID"
        _, report = deid.deidentify_dataset(ds)
        back = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
        if "PatientName" in original:
            assert str(back.PatientName) == report.patient_pseudonym, f
        text = " ".join(str(e.value) for e in back.iterall() if e.VR in ("PN", "LO", "SH", "ST", "LT", "UT", "UC"))
        name = str(original.get("PatientName", ""))
        parts = [p.strip() for g in name.split("=") for p in g.split("^") if len(p.strip()) >= 2]
        assert not [p for p in parts if p in text], f


def test_truncated_removed_value_still_matches_the_word_it_was_cut_from() -> None:
    ds = _image(PatientName="DOE^JANE", SeriesDescription="scan at Bartholomew General")
    ds.InstitutionName = "Bartholome"  # removed (X/Z/D); a prefix of a longer word in kept text
    out, _ = _deid(LONGITUDINAL).deidentify_dataset(roundtrip(ds))
    assert "Bartholome" not in out.SeriesDescription and out.SeriesDescription.startswith("scan at ")


def test_failed_items_are_dropped_even_with_a_plain_dataloader(tmp_path: Path) -> None:
    """Code that builds its own DataLoader (default collate, e.g. the trainer) gets batches
    without the failed items instead of a crash."""
    from torch.utils.data import DataLoader

    from securetrain.masking.dicom.dataset import DicomDataset

    for i in range(5):
        _write_ct(tmp_path / "in" / f"{i}.dcm")
    data = DicomDataset(tmp_path / "in", BASIC, SECRET, size=4)
    victim = Path(data.items[2][0])
    victim.write_bytes(victim.read_bytes()[:300])  # corrupted after indexing
    sizes = [b["pixels"].shape[0] for b in DataLoader(data, batch_size=2)]
    assert sum(sizes) == 4
    assert [q["path"] for q in data.quarantine_report()] == ["2.dcm"]

"""Burned-in handling across the pixel formats real US/SC devices write (no Tesseract needed:
fixed masks, known regions and a scripted OCR engine drive the decisions).

Each test names the defect it pins: pixels that were passed on unchecked, or written in a form
that no longer matches their header."""

from __future__ import annotations

import io

import numpy as np
import pydicom
import pytest
from burned_in_helpers import ScriptedEngine, frames_of, make_image, policy
from dicom_fixtures import POLICY_DIR, SECRET
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate
from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, JPEGBaseline8Bit, RLELossless

from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import BurnedInAnnotationError
from securetrain.masking.dicom.policy import load_policy

ROWS, COLS = 24, 40
RECT = [0, 0, 20, 6]  # x0, y0, x1, y1


def deid(pol, engine: ScriptedEngine | None = None) -> Deidentifier:
    d = Deidentifier(pol, SECRET) if pol.burned_in != "clean" else _clean_deid(pol, engine)
    return d


def _clean_deid(pol, engine: ScriptedEngine | None) -> Deidentifier:
    from securetrain.masking.dicom.burned_in import cleaner

    original = cleaner.TesseractEngine
    cleaner.TesseractEngine = lambda *a, **k: engine or ScriptedEngine()  # type: ignore[assignment,misc]
    try:
        return Deidentifier(pol, SECRET)
    finally:
        cleaner.TesseractEngine = original  # type: ignore[misc]


def written(ds: Dataset) -> Dataset:
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


def gray(flag: str | None = "YES", modality: str = "US") -> Dataset:
    ds, _ = make_image([], rows=ROWS, cols=COLS, bg="noise", flag=flag, modality=modality)
    return ds


def _native(ds: Dataset, raw: bytes, photometric: str, samples: int, planar: int | None = None) -> Dataset:
    ds.PhotometricInterpretation = photometric
    ds.SamplesPerPixel = samples
    if planar is not None:
        ds.PlanarConfiguration = planar
    ds.PixelData = raw
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


def rgb_image() -> np.ndarray:
    rng = np.random.default_rng(3)
    return rng.integers(40, 200, (ROWS, COLS, 3), dtype=np.uint8)


def colour(kind: str) -> Dataset:
    """Native colour objects as US/SC devices write them; ``jpeg``: baseline YBR_FULL_422."""
    from pydicom.pixels import convert_color_space

    rgb = rgb_image()
    ds = gray()
    if kind == "rgb-planar":
        return _native(ds, np.ascontiguousarray(rgb.transpose(2, 0, 1)).tobytes(), "RGB", 3, 1)
    ybr = convert_color_space(rgb, "RGB", "YBR_FULL")
    if kind == "ybr-full":
        return _native(ds, ybr.tobytes(), "YBR_FULL", 3, 0)
    if kind == "ybr-422":
        y, cb, cr = ybr[..., 0], ybr[:, 0::2, 1], ybr[:, 0::2, 2]
        raw = np.stack([y[:, 0::2], y[:, 1::2], cb, cr], -1).tobytes()  # Y Y Cb Cr per pixel pair
        return _native(ds, raw, "YBR_FULL_422", 3, 0)
    if kind == "jpeg":
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
        ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "YBR_FULL_422", 0
        ds.PixelData = encapsulate([buf.getvalue()])
        ds["PixelData"].is_undefined_length = True
        ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
        return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    raise ValueError(kind)


def assert_valid_native(out: Dataset) -> None:
    """Uncompressed pixel data is exactly Rows x Columns x frames x samples x bytes (padded to even)."""
    assert not out.file_meta.TransferSyntaxUID.is_compressed
    samples = 2 if str(out.PhotometricInterpretation).endswith("_422") else int(out.SamplesPerPixel)
    expected = int(out.Rows) * int(out.Columns) * int(out.get("NumberOfFrames", 1)) * samples * int(out.BitsAllocated) // 8
    assert len(out.PixelData) == expected + expected % 2


# --------------------------------------------------------------------------- float pixel data
def _float_image(flag: str | None) -> Dataset:
    ds = gray(flag=flag)
    del ds.PixelData
    for kw in ("BitsStored", "HighBit", "PixelRepresentation"):
        del ds[kw]
    ds.BitsAllocated = 32
    ds.FloatPixelData = np.linspace(0, 1, ROWS * COLS, dtype="<f4").tobytes()
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


@pytest.mark.parametrize("mode", ["reject", "clean"])
@pytest.mark.parametrize("flag", ["YES", None])
def test_flagged_float_pixel_data_is_refused_not_passed_unchecked(mode: str, flag: str | None) -> None:
    # Defect: only (7FE0,0010) Pixel Data was looked at, so a flagged or suspected object whose
    # pixels are Float (7FE0,0008) / Double Float (7FE0,0009) Pixel Data passed every mode unchecked.
    d = deid(policy(burned_in=mode))
    with pytest.raises(BurnedInAnnotationError):
        d.deidentify_dataset(_float_image(flag))
    assert d.burned_in.counts.refused == 1


def test_float_pixel_data_not_flagged_passes_and_allow_flagged_records_it() -> None:
    out, report = deid(policy(burned_in="clean")).deidentify_dataset(_float_image("NO"))
    assert report.burned_in == "none" and "FloatPixelData" in out
    _, report = deid(policy(burned_in="allow-flagged")).deidentify_dataset(_float_image("YES"))
    assert report.burned_in == "allowed-flagged"


# --------------------------------------------------------------------------- fixed pixel_masks
LEGACY = {"burned_in_annotation": "mask", "options": ["clean_pixel_data"],
          "pixel_masks": [{"modality": "US", "rects": [RECT]}]}
ALLOW = {"burned_in": "allow-flagged", "options": ["clean_pixel_data"],
         "pixel_masks": [{"modality": "US", "rects": [RECT]}]}


@pytest.mark.parametrize("mode", [LEGACY, ALLOW], ids=["reject+mask", "allow-flagged"])
@pytest.mark.parametrize("kind", ["rgb-planar", "ybr-full", "ybr-422", "jpeg"])
def test_pixel_masks_keep_colour_objects_valid(mode: dict, kind: str) -> None:
    # Defect: the pixel_masks path wrote the decoded (RGB, interleaved) array back under the
    # original header: Planar Configuration 1 and YBR_FULL objects came out scrambled (the mask
    # landing elsewhere than the rectangle), YBR_FULL_422 ones a third too long to decode, and
    # decoded JPEG baseline lost its Lossy Image Compression 01.
    ds = colour(kind)
    before = frames_of(ds).astype(np.int16)
    d = deid(policy(**mode))
    d.deidentify_dataset(ds)
    out = written(ds)
    assert_valid_native(out)
    assert out.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian  # documented: decoded, uncompressed
    assert out.PhotometricInterpretation == "RGB" and int(out.PlanarConfiguration) == 0
    after = frames_of(out).astype(np.int16)
    x0, y0, x1, y1 = RECT
    assert (after[:, y0:y1, x0:x1] == 0).all()
    outside = np.ones((ROWS, COLS), dtype=bool)
    outside[y0:y1, x0:x1] = False
    assert np.array_equal(after[:, outside], before[:, outside])
    if kind == "jpeg":
        assert out.LossyImageCompression == "01"


@pytest.mark.parametrize("ts", [RLELossless, ExplicitVRBigEndian])
def test_pixel_masks_on_rle_and_big_endian_stay_decodable(ts: str) -> None:
    ds = gray()
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, 12, 11
    values = np.random.default_rng(1).integers(0, 4096, (ROWS, COLS), dtype=np.uint16)
    ds.PixelData = values.astype("<u2").tobytes()
    ds["PixelData"].VR = "OW"
    if ts == RLELossless:
        ds.compress(RLELossless, generate_instance_uid=False)
    else:
        ds.file_meta.TransferSyntaxUID = ExplicitVRBigEndian
        ds.PixelData = values.astype(">u2").tobytes()
        buf = io.BytesIO()
        pydicom.dcmwrite(buf, ds, implicit_vr=False, little_endian=False, force_encoding=True)
        ds = pydicom.dcmread(io.BytesIO(buf.getvalue()))
    ds = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    deid(policy(**LEGACY)).deidentify_dataset(ds)
    out = written(ds)
    after = frames_of(out)[0, ..., 0]
    x0, y0, x1, y1 = RECT
    assert (after[y0:y1, x0:x1] == 0).all()
    assert np.array_equal(after[y1:], values[y1:])


# --------------------------------------------------------------------------- unused high bits
def _with_overlay_bits(flag: str | None, signed: bool = False) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """12 of 16 bits stored; an embedded (retired) overlay plane in bit 12 spells a shape
    standing in for a name. Returns the object, its stored values and the overlay bitmap."""
    ds = gray(flag=flag)
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, 12, 11
    rng = np.random.default_rng(5)
    values = rng.integers(-2048 if signed else 0, 2048 if signed else 4096, (ROWS, COLS)).astype(np.int32)
    overlay = np.zeros((ROWS, COLS), dtype=np.uint16)
    overlay[8:16, 4:30] = 1
    raw = (values.astype(np.uint16) & 0x0FFF) | (overlay << 12)
    ds.PixelRepresentation = 1 if signed else 0
    ds.PixelData = raw.astype("<u2").tobytes()
    ds["PixelData"].VR = "OW"
    ds.add_new(0x60000010, "US", ROWS)
    ds.add_new(0x60000011, "US", COLS)
    ds.add_new(0x60000040, "CS", "G")
    ds.add_new(0x60000050, "SS", [1, 1])
    ds.add_new(0x60000100, "US", 1)
    ds.add_new(0x60000102, "US", 12)  # Overlay Bit Position: the plane lives in the pixel data
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds))), values, overlay


def _high_bits(out: Dataset) -> np.ndarray:
    return np.frombuffer(out.PixelData, "<u2").reshape(ROWS, COLS) >> 12


@pytest.mark.parametrize("mode,flag", [("reject", "NO"), ("clean", "YES"), ("clean", None), ("allow-flagged", "NO")])
def test_overlay_bits_outside_bits_stored_do_not_survive(mode: str, flag: str | None) -> None:
    # Defect: bits above High Bit were passed on as read. An embedded overlay plane (text drawn
    # into bit 12 of 12-of-16-bit data) survived de-identification even though its 60xx group
    # was removed, and a file that OCR found clean was declared BurnedInAnnotation NO with it:
    # OCR sees only the stored bits, a loader reading raw uint16 sees the text.
    ds, values, overlay = _with_overlay_bits(flag)
    assert (_high_bits(ds) == overlay).all() and overlay.any()
    out, report = deid(policy(burned_in=mode)).deidentify_dataset(ds)
    out = written(out)
    assert not any(e.tag.group == 0x6000 for e in out)
    assert not _high_bits(out).any()
    assert np.array_equal(frames_of(out)[0, ..., 0], values)
    assert_valid_native(out)
    assert report.to_dict()["unused_pixel_bits_cleared"] is True


def test_sign_extension_and_clean_unused_bits_are_left_as_they_are() -> None:
    ds, values, _ = _with_overlay_bits("NO", signed=True)
    raw = values.astype(np.int16).astype("<i2").tobytes()  # sign-extended 12-bit values, no overlay
    ds.PixelData = raw
    out, report = deid(policy()).deidentify_dataset(ds)
    assert written(out).PixelData == raw and report.unused_pixel_bits_cleared is False


def test_overlay_kept_by_policy_keeps_its_bits() -> None:
    ds, _, overlay = _with_overlay_bits("NO")
    out, _ = deid(policy(overrides={"(6000,3000)": "K"})).deidentify_dataset(ds)
    assert (_high_bits(written(out)) == overlay).all()


def test_overlay_bits_in_big_endian_data_are_cleared_too() -> None:
    ds, values, _ = _with_overlay_bits("NO")
    raw = np.frombuffer(ds.PixelData, "<u2")
    ds.file_meta.TransferSyntaxUID = ExplicitVRBigEndian
    ds.PixelData = raw.astype(">u2").tobytes()
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, implicit_vr=False, little_endian=False, force_encoding=True)
    out, report = deid(policy()).deidentify_dataset(pydicom.dcmread(io.BytesIO(buf.getvalue())))
    out = written(out)
    assert report.unused_pixel_bits_cleared and out.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
    assert not _high_bits(out).any() and np.array_equal(frames_of(out)[0, ..., 0], values)


# --------------------------------------------------------------------------- suspected by SOP class
@pytest.mark.parametrize(
    "sop_class,modality",
    [
        ("1.2.840.10008.5.1.4.1.1.7", "CT"),  # Secondary Capture: a dose report screen saved by the CT
        ("1.2.840.10008.5.1.4.1.1.7.4", "MR"),  # Multi-frame True Color SC under the scanner's modality
        ("1.2.840.10008.5.1.4.1.1.6.1", None),  # Ultrasound Image without (Type 1) Modality
        ("1.2.840.10008.5.1.4.1.1.3.1", "IVUS"),  # Ultrasound Multi-frame from an intravascular probe
        ("1.2.840.10008.5.1.4.1.1.77.1.1.1", "XA"),  # Video Endoscopic
        ("1.2.840.10008.5.1.4.1.1.77.1.4", ""),  # VL Photographic
    ],
)
def test_sop_class_that_burns_in_text_is_suspected_whatever_the_modality(sop_class: str, modality: str | None) -> None:
    # Defect: suspicion (Burned In Annotation absent) went by Modality alone, so a Secondary
    # Capture written with its source's modality (CT, MR: dose reports, screen saves) or an
    # ultrasound object without Modality passed reject unchecked.
    from securetrain.masking.dicom.pixels import burned_in_status

    ds = gray(flag=None)
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = sop_class
    if modality is None:
        del ds.Modality
    else:
        ds.Modality = modality
    pol = policy()
    assert burned_in_status(ds, pol.burned_in_modalities) == "suspected"
    with pytest.raises(BurnedInAnnotationError, match="suspected"):
        deid(pol).deidentify_dataset(ds)
    # the policy's list still decides: a site that dropped SC from it is not overruled
    narrowed = policy(burned_in_modalities=["US"])
    expected = "suspected" if sop_class.startswith(("1.2.840.10008.5.1.4.1.1.6", "1.2.840.10008.5.1.4.1.1.3")) else "no"
    assert burned_in_status(ds, narrowed.burned_in_modalities) == expected


XA_RF_SOP_CLASSES = [
    "1.2.840.10008.5.1.4.1.1.12.1",  # X-Ray Angiographic Image
    "1.2.840.10008.5.1.4.1.1.12.1.1",  # Enhanced XA Image
    "1.2.840.10008.5.1.4.1.1.12.2",  # X-Ray Radiofluoroscopic Image
    "1.2.840.10008.5.1.4.1.1.12.2.1",  # Enhanced XRF Image
    "1.2.840.10008.5.1.4.1.1.12.3",  # X-Ray Angiographic Bi-Plane Image (retired)
]


@pytest.mark.parametrize("modality", ["XA", "RF", "xa "])
def test_xa_and_rf_are_suspected_by_default(modality: str) -> None:
    # Defect: angiography / fluoroscopy runs (which routinely carry the patient's name, ID and
    # date burned into the live image) without Burned In Annotation passed reject unchecked.
    from securetrain.masking.dicom.pixels import burned_in_status

    ds = gray(flag=None, modality=modality)
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.12.1"
    for pol in (policy(), *(load_policy(f) for f in sorted(POLICY_DIR.glob("dicom-*.yaml")))):
        assert {"XA", "RF"} <= set(pol.burned_in_modalities)
        assert burned_in_status(ds, pol.burned_in_modalities) == "suspected"
    with pytest.raises(BurnedInAnnotationError, match="suspected"):
        deid(policy()).deidentify_dataset(ds)
    ds.BurnedInAnnotation = "NO"  # the device says so: not suspected
    assert burned_in_status(ds, policy().burned_in_modalities) == "no"


@pytest.mark.parametrize("sop_class", XA_RF_SOP_CLASSES)
def test_xa_and_rf_sop_classes_are_suspected_whatever_the_modality(sop_class: str) -> None:
    from securetrain.masking.dicom.pixels import burned_in_status

    ds = gray(flag=None, modality="OT")
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = sop_class
    del ds.Modality
    assert burned_in_status(ds, policy().burned_in_modalities) == "suspected"
    # configurable: a site whose angiography systems never burn text in drops XA and RF
    others = [m for m in policy().burned_in_modalities if m not in ("XA", "RF")]
    assert burned_in_status(ds, policy(burned_in_modalities=others).burned_in_modalities) == "no"
    ds.Modality = "XA"
    assert burned_in_status(ds, policy(burned_in_modalities=others).burned_in_modalities) == "no"


def test_ordinary_ct_is_not_suspected() -> None:
    from securetrain.masking.dicom.pixels import burned_in_status

    ds = gray(flag=None, modality="CT")
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    assert burned_in_status(ds, policy().burned_in_modalities) == "no"


def test_unknown_transfer_syntax_is_not_a_crash_of_the_unused_bits_check() -> None:
    ds, _, _ = _with_overlay_bits("NO")
    ds.file_meta.TransferSyntaxUID = "1.2.3.4.5.6"  # private syntax: not read, not rewritten
    raw = ds.PixelData
    out, report = deid(policy()).deidentify_dataset(ds)
    assert out.PixelData == raw and not report.unused_pixel_bits_cleared

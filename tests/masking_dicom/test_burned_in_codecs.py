"""burned_in: clean on compressed inputs: RLE, JPEG baseline, JPEG 2000 (lossless and lossy).

Masked pixels are re-encoded per the documented rules (lossless stays in its syntax, lossy goes
to JPEG 2000 Lossless with Lossy Image Compression kept at 01), the output decodes, and pixels
outside the masks equal the decoded input exactly."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pydicom
import pytest
from burned_in_helpers import Text, frames_of, make_image, normalise, ocr_text, region_map
from dicom_fixtures import SECRET
from pydicom.encaps import encapsulate
from pydicom.uid import (
    JPEG2000,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    RLELossless,
)

from securetrain.masking.dicom.burned_in.codec import target_syntax
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.policy import load_policy

pytestmark = [
    pytest.mark.skipif(shutil.which("tesseract") is None, reason="needs the tesseract-ocr package (.ci/run installs it)"),
    pytest.mark.slow,
]

TEXTS = [Text("DOE^JOHN 84412977", 8, 8, 16), Text("2023-04-05", 120, 100, 15, 0.9)]
PHI = {"DOE", "JOHN", "84412977", "20230405"}


def _policy():
    return load_policy(data={"policy_version": 1, "name": "codec-test", "profile": "basic", "burned_in": "clean"})


def _jpeg_baseline(ds: pydicom.Dataset) -> pydicom.Dataset:
    """Encode the (8-bit, single-frame) image as JPEG baseline with Pillow and encapsulate it."""
    from PIL import Image

    frame = frames_of(ds)[0]
    buf = io.BytesIO()
    if frame.shape[-1] == 3:
        Image.fromarray(frame).save(buf, format="JPEG", quality=92)
        ds.PhotometricInterpretation = "YBR_FULL_422"
    else:
        Image.fromarray(frame[..., 0]).save(buf, format="JPEG", quality=92)
    ds.PixelData = encapsulate([buf.getvalue()])
    ds["PixelData"].VR = "OB"
    ds["PixelData"].is_undefined_length = True
    ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
    ds.LossyImageCompression = "01"
    ds.LossyImageCompressionMethod = "ISO_10918_1"
    ds.LossyImageCompressionRatio = "8"
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


def _compressed(kind: str, rgb: bool, frames: int = 1) -> pydicom.Dataset:
    ds, _ = make_image(TEXTS, rows=140, cols=260, bg="gradient", rgb=rgb, frames=frames, seed=2)
    if kind == "jpeg":
        return _jpeg_baseline(ds)
    if kind == "rle":
        ds.compress(RLELossless, generate_instance_uid=False)
    elif kind == "j2k":
        ds.compress(JPEG2000Lossless, generate_instance_uid=False)
    elif kind == "j2k-lossy":
        ds.compress(JPEG2000, j2k_cr=[10], generate_instance_uid=False)
        ds.LossyImageCompression = "01"
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


@pytest.mark.parametrize(
    "kind,rgb,frames,expected_ts,lossy",
    [
        ("rle", False, 2, RLELossless, False),
        ("rle", True, 1, RLELossless, False),
        ("j2k", False, 1, JPEG2000Lossless, False),
        ("j2k-lossy", False, 1, JPEG2000Lossless, True),
        ("jpeg", False, 1, JPEG2000Lossless, True),
        ("jpeg", True, 1, JPEG2000Lossless, True),
    ],
)
def test_compressed_inputs_round_trip(kind: str, rgb: bool, frames: int, expected_ts: str, lossy: bool) -> None:
    ds = _compressed(kind, rgb, frames)
    before = frames_of(ds).copy()  # decoded input (what a viewer shows)
    assert PHI & set(_present(ocr_text(ds)))
    deid = Deidentifier(_policy(), SECRET)
    _, report = deid.deidentify_dataset(ds)
    out = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    assert out.file_meta.TransferSyntaxUID == expected_ts
    after = frames_of(out)
    assert after.shape == before.shape
    cover = region_map(report.burned_in_detail.regions, before.shape[1], before.shape[2])
    outside = np.broadcast_to(~cover[None, :, :, None], before.shape)
    assert np.array_equal(after[outside], before[outside])  # lossless re-encoding, exact
    assert _present(ocr_text(out)) == []
    assert out.BurnedInAnnotation == "NO"
    if lossy:
        assert out.LossyImageCompression == "01"  # went through lossy compression once, forever lossy
        assert "LossyImageCompressionMethod" not in ds or out.LossyImageCompressionMethod == ds.LossyImageCompressionMethod
    else:
        assert str(out.get("LossyImageCompression", "00")) == "00"
    if rgb:
        assert out.SamplesPerPixel == 3 and after.shape[-1] == 3
        assert out.PhotometricInterpretation in ("RGB", "YBR_RCT")  # YBR JPEG decoded to RGB, J2K lossless MCT
    assert report.burned_in_detail.transfer_syntax == expected_ts


def test_compressed_input_without_text_is_not_reencoded() -> None:
    ds, _ = make_image([], rows=64, cols=96, bg="gradient", seed=4)
    ds.compress(RLELossless, generate_instance_uid=False)
    ds = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    original = ds.PixelData
    Deidentifier(_policy(), SECRET).deidentify_dataset(ds)
    assert ds.PixelData == original and ds.file_meta.TransferSyntaxUID == RLELossless


def test_target_syntax_rules() -> None:
    from pydicom.uid import ExplicitVRBigEndian, ImplicitVRLittleEndian, JPEGExtended12Bit

    assert target_syntax(ExplicitVRLittleEndian) == ExplicitVRLittleEndian
    assert target_syntax(ImplicitVRLittleEndian) == ImplicitVRLittleEndian
    assert target_syntax(ExplicitVRBigEndian) == ExplicitVRLittleEndian
    assert target_syntax(RLELossless) == RLELossless
    assert target_syntax(JPEGExtended12Bit) == JPEG2000Lossless


def _present(text: str) -> list[str]:
    return sorted(p for p in PHI if normalise(p) in text)

"""Masking re-encodes real compressed files correctly (pydicom's test files; known regions, so no
OCR is needed): transfer syntax per the documented rules, lossy flag, photometric, and exact
pixels outside the masks."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pydicom
import pytest
from burned_in_helpers import frames_of
from dicom_fixtures import SECRET
from pydicom.data import get_testdata_file
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian, JPEG2000Lossless, RLELossless

from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.policy import load_policy

CASES = [
    # file, expected output transfer syntax, lossy afterwards
    ("SC_rgb_rle.dcm", RLELossless, False),
    ("OBXXXX1A_rle_2frame.dcm", RLELossless, False),
    ("SC_rgb_jpeg_dcmtk.dcm", JPEG2000Lossless, True),  # JPEG baseline, YBR_FULL_422
    ("US1_J2KR.dcm", JPEG2000Lossless, False),
    ("US1_J2KI.dcm", JPEG2000Lossless, True),  # JPEG 2000 irreversible
    ("SC_ybr_full_uncompressed.dcm", ExplicitVRLittleEndian, False),
    ("SC_rgb_expb_16bit.dcm", ExplicitVRLittleEndian, False),  # big endian in
    ("gdcm-US-ALOKA-16.dcm", ImplicitVRLittleEndian, False),
]


@pytest.mark.parametrize("name,expected_ts,lossy", CASES)
def test_known_region_masking_reencodes_validly(name: str, expected_ts: str, lossy: bool) -> None:
    path = get_testdata_file(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = pydicom.dcmread(path)
        before = frames_of(ds).copy()
        was_lossy = str(ds.get("LossyImageCompression", "")) == "01"
        rows, cols = int(ds.Rows), int(ds.Columns)
        ds.BurnedInAnnotation = "NO"  # known regions only: no OCR in this test
        box = (cols // 4, rows // 4, cols // 2, rows // 2)
        pol = load_policy(data={"policy_version": 1, "name": "reencode", "profile": "basic", "burned_in": "clean",
                                "known_regions": [{"rows": rows, "columns": cols, "label": "test box", "rects": [box]}]})
        deid = Deidentifier(pol, SECRET)
        _, report = deid.deidentify_dataset(ds)
        out = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
        after = frames_of(out)
    assert out.file_meta.TransferSyntaxUID == expected_ts
    assert report.burned_in_detail.action == "masked" and report.pixels_masked
    assert after.shape == before.shape
    inside = np.zeros(before.shape, dtype=bool)
    inside[:, box[1] : box[3], box[0] : box[2], :] = True
    assert np.array_equal(after[~inside], before[~inside])
    photometric = str(out.PhotometricInterpretation)
    black = before.max() if photometric == "MONOCHROME1" else (before.min() if photometric.startswith("MONO") else 0)
    assert (after[inside] == black).all()
    # lossy once, lossy forever (some of these files were decompressed from JPEG and say so)
    assert (str(out.get("LossyImageCompression", "00")) == "01") is (lossy or was_lossy)
    if before.shape[-1] == 3:
        assert photometric in ("RGB", "YBR_RCT") and int(out.get("PlanarConfiguration", 0)) == 0
    assert out.BurnedInAnnotation == "NO"
    assert "masked known ({},{},{},{}) test box".format(*box) in list(out.DeidentificationMethod)
    assert deid.burned_in.counts.masked == 1

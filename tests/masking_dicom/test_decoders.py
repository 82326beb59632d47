"""Compressed pixel data from real files: JPEG Lossless / JPEG-LS decode through GDCM (lossless:
the same pixels as the native original), and GDCM never takes over a syntax another plugin decodes."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
from pydicom import dcmread
from pydicom.data import get_testdata_file
from pydicom.pixels import get_decoder
from pydicom.uid import (
    JPEG2000,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGLosslessSV1,
    JPEGLSLossless,
    RLELossless,
)

import securetrain.masking.dicom.engine  # noqa: F401 - importing the engine configures the decoders
from securetrain.masking.dicom.dataset import DicomDataset

pytest.importorskip("gdcm")

REPO = Path(__file__).resolve().parents[2]
BASIC = REPO / "policies" / "dicom-basic.yaml"
SECRET = bytes(range(32))


def test_gdcm_decodes_jpeg_lossless_and_jpeg_ls() -> None:
    for uid in (JPEGLosslessSV1, JPEGLSLossless):
        assert get_decoder(uid).is_available, uid.name


@pytest.mark.parametrize("uid", [JPEGBaseline8Bit, JPEG2000, JPEG2000Lossless, RLELossless])
def test_gdcm_is_only_the_last_resort_where_another_plugin_decodes(uid) -> None:  # noqa: ANN001
    # The order pydicom tries them in (``available_plugins`` is sorted by name, not that order).
    plugins = list(get_decoder(uid)._available)
    others = [p for p in plugins if p != "gdcm"]
    assert others, f"{uid.name}: no plugin but GDCM"
    assert plugins[: len(others)] == others  # GDCM, where present, comes after every other plugin


def _manifest(tmp_path: Path, names: list[str]) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    with (root / "manifest.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label"])
        for i, name in enumerate(names):
            shutil.copy(get_testdata_file(name), root / f"{i:02d}.dcm")
            writer.writerow([f"{i:02d}.dcm", i % 2])
    return root / "manifest.csv"


def test_jpeg_ls_lossless_loads_as_the_same_pixels_as_its_native_original(tmp_path: Path) -> None:
    native, compressed = "MR_small.dcm", "MR_small_jpeg_ls_lossless.dcm"
    assert dcmread(get_testdata_file(compressed)).file_meta.TransferSyntaxUID == JPEGLSLossless
    ds = DicomDataset(_manifest(tmp_path, [native, compressed]), BASIC, SECRET, size=32)
    assert ds.quarantine_report() == []
    a, b = ds[0], ds[1]
    assert a is not None and b is not None
    assert a["pixels"].shape == b["pixels"].shape == (1, 32, 32)
    assert np.array_equal(a["pixels"].numpy(), b["pixels"].numpy())


def test_jpeg_lossless_process_14_from_pydicom_data_loads(tmp_path: Path) -> None:
    try:
        path = get_testdata_file("JPGLosslessP14SV1_1s_1f_8b.dcm")
    except Exception:  # noqa: BLE001 - pydicom-data not installed (it is in the dev extra)
        path = None
    if path is None:
        pytest.skip("pydicom-data's JPEG Lossless file is not installed")
    assert dcmread(path).file_meta.TransferSyntaxUID == JPEGLosslessSV1
    ds = DicomDataset(_manifest(tmp_path, ["JPGLosslessP14SV1_1s_1f_8b.dcm"]), BASIC, SECRET, size=16)
    assert ds.quarantine_report() == []
    item = ds[0]
    assert item is not None and item["pixels"].shape == (1, 16, 16)
    assert float(item["pixels"].max()) > float(item["pixels"].min())  # an image, not a blank

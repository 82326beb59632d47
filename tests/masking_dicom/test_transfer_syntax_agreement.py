"""The transfer syntax an output names and the encoding of its Pixel Data agree.

* Lossless compressed inputs that are written uncompressed (no encoder installed for JPEG Lossless
  process 14, JPEG-LS, HTJ2K; or Clean Pixel Data's fixed ``pixel_masks``, which always decode)
  say Explicit VR Little Endian, carry native, defined-length pixel data of exactly the header's
  size, claim no lossy compression, and decode (pydicom and GDCM) to the input's pixels.
* An object whose Pixel Data contradicts its transfer syntax (a compressed syntax over native
  bytes, or encapsulated fragments under a native syntax: a tool that decompressed without
  updating the syntax, or the reverse) is refused with the reason -- it was passed on as it was,
  so the output claimed a compression it did not have (or hid one it had)."""

from __future__ import annotations

import io
import struct
import warnings
from pathlib import Path

import numpy as np
import pydicom
import pytest
from burned_in_helpers import frames_of
from dicom_fixtures import SECRET, gdcm_read, make_dataset
from pydicom.data import get_testdata_file
from pydicom.dataset import Dataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.uid import ExplicitVRLittleEndian, JPEG2000Lossless, JPEGLosslessSV1, RLELossless

from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import DeidError, UnreadableDicomError
from securetrain.masking.dicom.policy import load_policy

BASE = {"policy_version": 1, "name": "ts", "profile": "basic"}


def _policy(mode: str, rows: int, cols: int) -> object:
    box = [0, 0, cols // 2, rows // 4]
    if mode == "pixel_masks":
        return load_policy(data={**BASE, "burned_in_annotation": "mask", "options": ["clean_pixel_data"],
                                 "pixel_masks": [{"rects": [box]}]})
    return load_policy(data={**BASE, "burned_in": "clean", "known_regions": [{"rows": rows, "rects": [box]}]})


def _gdcm_transcoded(name: str, ts: str, tmp: Path) -> Path:
    """pydicom's MR_small as JPEG Lossless SV1 (GDCM encodes it; no pydicom encoder exists)."""
    gdcm = pytest.importorskip("gdcm")
    reader = gdcm.ImageReader()
    reader.SetFileName(str(get_testdata_file(name)))
    assert reader.Read()
    change = gdcm.ImageChangeTransferSyntax()
    change.SetTransferSyntax(gdcm.TransferSyntax(gdcm.TransferSyntax.GetTSType(ts)))
    change.SetInput(reader.GetImage())
    assert change.Change()
    writer = gdcm.ImageWriter()
    writer.SetFile(reader.GetFile())
    writer.SetImage(change.GetOutput())
    out = tmp / "p14.dcm"
    writer.SetFileName(str(out))
    assert writer.Write()
    return out


def _gdcm_reads(blob: bytes) -> bool:
    try:
        import gdcm  # noqa: F401
    except ImportError:  # pragma: no cover - python-gdcm is a dependency
        return True
    with gdcm_read(blob) as reader:
        return reader is not None


INPUTS = [
    ("MR_small_jpeg_ls_lossless.dcm", "clean"),  # JPEG-LS lossless: no encoder -> native
    ("MR_small_jpeg_ls_lossless.dcm", "pixel_masks"),
    ("MR_small_jp2klossless.dcm", "pixel_masks"),  # an encoder exists, but pixel_masks decode
    ("SC_rgb_rle.dcm", "pixel_masks"),
    ("p14", "clean"),  # JPEG Lossless SV1 (process 14): no encoder -> native
]


@pytest.mark.parametrize("name,mode", INPUTS)
def test_lossless_input_written_uncompressed_says_so(name: str, mode: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = _gdcm_transcoded("MR_small.dcm", JPEGLosslessSV1, tmp_path) if name == "p14" else get_testdata_file(name)
        ds = pydicom.dcmread(path)
        assert ds.file_meta.TransferSyntaxUID.is_compressed
        ds.PatientID = ds.get("PatientID") or "TS-1"
        ds.BurnedInAnnotation = "YES" if mode == "pixel_masks" else "NO"
        before = frames_of(ds).copy()
        rows, cols = int(ds.Rows), int(ds.Columns)
        _, report = Deidentifier(_policy(mode, rows, cols), SECRET).deidentify_dataset(ds)
        blob = encode_dataset(ds)
        out = pydicom.dcmread(io.BytesIO(blob))
    ts = out.file_meta.TransferSyntaxUID
    assert ts == ExplicitVRLittleEndian
    pixels = out["PixelData"]
    assert not pixels.is_undefined_length and pixels.VR in ("OB", "OW")
    assert not pixels.value.startswith(b"\xfe\xff\x00\xe0")  # no encapsulation items
    size = rows * cols * int(out.get("NumberOfFrames", 1) or 1) * int(out.SamplesPerPixel) * int(out.BitsAllocated) // 8
    assert len(pixels.value) == size + size % 2
    assert str(out.get("LossyImageCompression", "00")) == "00"  # lossless in, lossless out
    assert "ExtendedOffsetTable" not in out
    assert report.pixels_masked and _gdcm_reads(blob)
    after = frames_of(out)
    assert np.array_equal(after[:, rows // 4 :], before[:, rows // 4 :])


# ----------------------------------------------------------------------------- contradicting inputs
def _ct() -> Dataset:
    ds = make_dataset()
    for tag in [e.tag for e in ds if 0x5000 <= e.tag >> 16 <= 0x60FF]:
        del ds[tag]
    ds.BurnedInAnnotation = "NO"
    ds.Rows = ds.Columns = 8
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    return ds


def _write_raw(ds: Dataset, pixel_element: bytes) -> bytes:
    """Preamble, file meta as given, the data set in Explicit VR Little Endian, then ``pixel_element``."""
    fp = DicomBytesIO()
    fp.write(b"\x00" * 128 + b"DICM")
    write_file_meta_info(fp, ds.file_meta, enforce_standard=True)
    body = DicomBytesIO()
    body.is_implicit_VR, body.is_little_endian = False, True
    write_dataset(body, ds)
    return fp.getvalue() + body.getvalue() + pixel_element


def _native_under_compressed_syntax() -> bytes:
    ds = _ct()
    ds.file_meta.TransferSyntaxUID = JPEG2000Lossless  # says compressed ...
    data = np.arange(64, dtype="<u2").tobytes()  # ... holds native bytes
    return _write_raw(ds, struct.pack("<HH2sHI", 0x7FE0, 0x0010, b"OW", 0, len(data)) + data)


def _encapsulated_under_native_syntax() -> bytes:
    ds = _ct()
    arr = np.arange(64, dtype="<u2").reshape(8, 8)
    ds.PixelData = arr.tobytes()
    ds.compress(RLELossless, arr, generate_instance_uid=False)
    fragments = ds.PixelData
    del ds.PixelData
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian  # says native ... holds RLE fragments
    return _write_raw(ds, struct.pack("<HH2sHI", 0x7FE0, 0x0010, b"OB", 0, 0xFFFFFFFF) + fragments
                      + struct.pack("<HHI", 0xFFFE, 0xE0DD, 0))


@pytest.mark.parametrize("make,reason", [
    (_native_under_compressed_syntax, "not encapsulated"),
    (_encapsulated_under_native_syntax, "holds encapsulated fragments"),
])
def test_pixel_data_contradicting_its_transfer_syntax_is_refused(make, reason: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Defect: these were de-identified and written as they were: the output named a transfer
    # syntax its pixel data did not have, so no reader could decode it.
    src = tmp_path / "in.dcm"
    src.write_bytes(make())
    deid = Deidentifier(load_policy(data=BASE), SECRET)
    with pytest.raises(UnreadableDicomError, match=reason):
        deid.deidentify_file(src, tmp_path / "out.dcm")
    assert not (tmp_path / "out.dcm").exists()
    # an in-memory object (deidentify_dataset + encode_dataset) is refused when it is encoded
    ds = pydicom.dcmread(src)
    deid.deidentify_dataset(ds)
    with pytest.raises(DeidError, match=reason):
        encode_dataset(ds)


def test_implicit_vr_data_set_under_a_compressed_syntax_is_written_explicit(tmp_path: Path) -> None:
    """pydicom's SC_rgb_jpeg.dcm: JPEG Baseline in the file meta (a compressed syntax, always Explicit VR
    Little Endian) over a data set its writer encoded in Implicit VR. pydicom reads it (with a warning);
    de-identification then failed to write it, `cannot encode the de-identified object (TypeError)`,
    and a folder run quarantined a file every viewer opens. It is written in Explicit VR now, with
    the compressed pixels untouched."""
    src = get_testdata_file("SC_rgb_jpeg.dcm")
    deid = Deidentifier(load_policy(data={**BASE, "burned_in_modalities": [], "missing_patient_identity": "study"}), SECRET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom: "Expected explicit VR, but found implicit VR"
        report = deid.deidentify_file(src, tmp_path / "out.dcm")
        original = pydicom.dcmread(src)
    assert report.output == str(tmp_path / "out.dcm")
    raw = (tmp_path / "out.dcm").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read back without any VR guessing
        out = pydicom.dcmread(io.BytesIO(raw))
        out.decode()
    assert out.file_meta.TransferSyntaxUID == original.file_meta.TransferSyntaxUID
    assert out["ImageType"].VR == "CS" and out["PixelData"].VR == "OB"
    assert raw.count(b"CS") > 0 and out.PixelData == original.PixelData  # fragments passed through
    assert np.array_equal(out.pixel_array, original.pixel_array)

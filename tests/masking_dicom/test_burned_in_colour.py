"""YBR colour in, masked colour out: whatever is written, Photometric Interpretation, Planar
Configuration and the pixel data agree, so every reader decodes the input's colours.

Inputs: YBR_FULL (Planar Configuration 0 and 1) and YBR_FULL_422, uncompressed and RLE Lossless,
one and two frames, through both masking paths (Clean Pixel Data ``pixel_masks`` and
``burned_in: clean`` with a known region; no OCR needed). Each output is decoded three ways and
compared with the input's colours outside the mask: pydicom, the raw bytes read by the header's
own rules (no colour conversion by any library) and GDCM (an independent decoder)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pydicom
import pytest
from burned_in_helpers import frames_of, make_image, policy
from dicom_fixtures import SECRET, gdcm_read
from pydicom.data import get_testdata_file
from pydicom.dataset import Dataset
from pydicom.pixels import convert_color_space
from pydicom.uid import ExplicitVRLittleEndian, RLELossless

from securetrain.masking.dicom.burned_in.codec import decode_frames
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import BurnedInAnnotationError

ROWS, COLS = 24, 40
RECT = (0, 0, 20, 6)  # x0, y0, x1, y1 (exclusive)
OUTSIDE = np.ones((ROWS, COLS), dtype=bool)
OUTSIDE[RECT[1] : RECT[3], RECT[0] : RECT[2]] = False

MASKS = {"burned_in_annotation": "mask", "options": ["clean_pixel_data"],
         "pixel_masks": [{"modality": "US", "rects": [list(RECT)]}]}
CLEAN = {"burned_in": "clean", "known_regions": [{"rows": ROWS, "columns": COLS, "rects": [list(RECT)]}]}


def _truth(frames: int) -> np.ndarray:
    """RGB colours that survive YBR_FULL and 4:2:2 exactly (chroma constant per pixel pair)."""
    rgb = np.random.default_rng(11).integers(30, 220, (frames, ROWS, COLS // 2, 3), dtype=np.uint8).repeat(2, axis=2)
    return convert_color_space(convert_color_space(rgb, "RGB", "YBR_FULL"), "YBR_FULL", "RGB")


def _ybr_object(photometric: str, encoding: str, frames: int, planar: int) -> Dataset:
    ds, _ = make_image([], rows=ROWS, cols=COLS, bg="noise", flag="YES", modality="US")
    ybr = convert_color_space(_truth(frames), "RGB", "YBR_FULL")
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, photometric, planar
    if frames > 1:
        ds.NumberOfFrames = frames
    if photometric == "YBR_FULL_422":
        y, cb, cr = ybr[..., 0], ybr[..., 0::2, 1], ybr[..., 0::2, 2]
        ds.PixelData = np.stack([y[..., 0::2], y[..., 1::2], cb, cr], -1).tobytes()  # Y Y Cb Cr per pair
    elif planar:
        ds.PixelData = np.ascontiguousarray(ybr.transpose(0, 3, 1, 2)).tobytes()
    else:
        ds.PixelData = ybr.tobytes()
    if encoding == "rle":
        ds.compress(RLELossless, ybr if frames > 1 else ybr[0], generate_instance_uid=False)
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


def _raw_colours(out: Dataset) -> np.ndarray:
    """Native output read by the header alone: (frames, rows, cols, 3) in the header's colour space."""
    frames = int(out.get("NumberOfFrames", 1) or 1)
    data = np.frombuffer(out.PixelData, np.uint8)
    photometric = str(out.PhotometricInterpretation)
    if photometric.endswith("_422"):
        pairs = data[: frames * ROWS * COLS * 2].reshape(frames, ROWS, COLS // 2, 4)
        full = np.empty((frames, ROWS, COLS, 3), np.uint8)
        full[..., 0::2, 0], full[..., 1::2, 0] = pairs[..., 0], pairs[..., 1]
        full[..., 1] = pairs[..., 2].repeat(2, axis=-1)
        full[..., 2] = pairs[..., 3].repeat(2, axis=-1)
    elif int(out.get("PlanarConfiguration", 0) or 0) == 1:
        full = data[: frames * ROWS * COLS * 3].reshape(frames, 3, ROWS, COLS).transpose(0, 2, 3, 1)
    else:
        full = data[: frames * ROWS * COLS * 3].reshape(frames, ROWS, COLS, 3)
    if photometric == "RGB":
        return full
    assert photometric.startswith("YBR_FULL"), photometric
    return convert_color_space(np.ascontiguousarray(full), "YBR_FULL", "RGB")


def _gdcm_colours(blob: bytes, frames: int) -> np.ndarray | None:
    try:
        import gdcm  # noqa: F401
    except ImportError:  # pragma: no cover - python-gdcm is a dependency
        return None
    with gdcm_read(blob) as reader:
        assert reader is not None, "GDCM cannot read the output"
        image = reader.GetImage()
        buf = image.GetBuffer()
        data = np.frombuffer(buf.encode("utf-8", "surrogateescape") if isinstance(buf, str) else buf, np.uint8)
        pi = str(image.GetPhotometricInterpretation()).strip()
    colours = data[: frames * ROWS * COLS * 3].reshape(frames, ROWS, COLS, 3)
    return colours if pi == "RGB" else convert_color_space(np.ascontiguousarray(colours), "YBR_FULL", "RGB")


def _deid(mode: dict) -> Deidentifier:
    return Deidentifier(policy(**mode), SECRET)


def _check_output(ds: Dataset, frames: int) -> Dataset:
    blob = encode_dataset(ds)
    out = pydicom.dcmread(io.BytesIO(blob))
    truth = _truth(frames).astype(int)
    # the header describes interleaved RGB (or J2K's YBR_RCT); the pixel data has exactly that size
    assert out.PhotometricInterpretation in ("RGB", "YBR_RCT")
    assert int(out.SamplesPerPixel) == 3 and int(out.PlanarConfiguration) == 0
    assert int(out.get("NumberOfFrames", 1) or 1) == frames
    decoded = frames_of(out).astype(int)
    assert (decoded[:, ~OUTSIDE] == 0).all()  # masked with RGB black
    assert np.abs(decoded[:, OUTSIDE] - truth[:, OUTSIDE]).max() == 0, "pydicom decodes other colours"
    if not out.file_meta.TransferSyntaxUID.is_compressed:
        expected = ROWS * COLS * frames * 3
        assert len(out.PixelData) == expected + expected % 2
        raw = _raw_colours(out).astype(int)
        assert np.abs(raw[:, OUTSIDE] - truth[:, OUTSIDE]).max() <= 1, "the bytes are not the header's colours"
    independent = _gdcm_colours(blob, frames)
    if independent is not None:
        assert np.abs(independent[:, OUTSIDE].astype(int) - truth[:, OUTSIDE]).max() <= 1, "GDCM decodes other colours"
    return out


CASES = [
    ("YBR_FULL", "native", 1, 0),
    ("YBR_FULL", "native", 2, 1),
    ("YBR_FULL_422", "native", 1, 0),
    ("YBR_FULL_422", "native", 2, 0),
    ("YBR_FULL", "rle", 1, 0),
    ("YBR_FULL", "rle", 2, 0),
]


@pytest.mark.parametrize("photometric,encoding,frames,planar", CASES)
@pytest.mark.parametrize("mode", [MASKS, CLEAN], ids=["pixel_masks", "clean-known-region"])
@pytest.mark.parametrize("as_rgb", [True, False], ids=["default-options", "caller-as_rgb-False"])
def test_masked_ybr_output_decodes_to_the_input_colours(
    photometric: str, encoding: str, frames: int, planar: int, mode: dict, as_rgb: bool
) -> None:
    # Defect: the masked pixels were written as whatever pydicom's pixel_array returned, and the
    # header relabelled RGB on the assumption that it was RGB. A dataset read with
    # pixel_array_options(as_rgb=False) (a caller's choice pydicom honours) decoded to YCbCr, which
    # was then written under "RGB": every reader showed other colours.
    ds = _ybr_object(photometric, encoding, frames, planar)
    assert np.abs(frames_of(ds).astype(int) - _truth(frames).astype(int)).max() <= 1  # the input is right
    if mode is CLEAN:
        ds.BurnedInAnnotation = "NO"  # known region only: no OCR
    if not as_rgb:
        ds.pixel_array_options(as_rgb=False)
    _, report = _deid(mode).deidentify_dataset(ds)
    assert report.pixels_masked
    out = _check_output(ds, frames)
    expected_ts = RLELossless if encoding == "rle" and mode is CLEAN else ExplicitVRLittleEndian
    assert out.file_meta.TransferSyntaxUID == expected_ts


@pytest.mark.parametrize("name", ["SC_ybr_full_uncompressed.dcm", "SC_ybr_full_422_uncompressed.dcm"])
def test_real_ybr_files_keep_their_colours_whatever_the_callers_options(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        truth = frames_of(pydicom.dcmread(get_testdata_file(name))).astype(int)
        ds = pydicom.dcmread(get_testdata_file(name))
    ds.pixel_array_options(as_rgb=False)
    ds.BurnedInAnnotation = "NO"
    box = [0, 0, 10, 10]
    Deidentifier(policy(burned_in="clean", known_regions=[{"rows": int(ds.Rows), "rects": [box]}]),
                 SECRET).deidentify_dataset(ds)
    out = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    assert out.PhotometricInterpretation == "RGB" and int(out.PlanarConfiguration) == 0
    after = frames_of(out).astype(int)
    assert np.array_equal(after[:, 10:, :], truth[:, 10:, :]) and np.array_equal(after[:, :, 10:], truth[:, :, 10:])


def test_decode_frames_returns_rgb_for_ybr_and_refuses_unconvertible_ybr() -> None:
    ds = _ybr_object("YBR_FULL", "native", 1, 0)
    ds.pixel_array_options(as_rgb=False)
    assert np.abs(decode_frames(ds)[0].astype(int) - _truth(1)[0].astype(int)).max() <= 1
    # YBR_PARTIAL_422 (retired): no converter -- refused with the reason, never written as "RGB"
    partial = _ybr_object("YBR_FULL_422", "native", 1, 0)
    partial.PhotometricInterpretation = "YBR_PARTIAL_422"
    with pytest.raises(BurnedInAnnotationError, match="YBR_PARTIAL_422"):
        decode_frames(partial)


def test_written_samples_have_the_headers_width_whatever_the_decoder_returned() -> None:
    """A decoder may hand back 8-bit samples for Bits Allocated 16 (or the reverse); the bytes
    written must be Bits Allocated wide, or the header describes other pixels."""
    from securetrain.masking.dicom.burned_in.codec import write_pixels

    ds, _ = make_image([], rows=ROWS, cols=COLS, bg="noise", flag="YES", modality="US")
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    values = np.random.default_rng(2).integers(0, 256, (1, ROWS, COLS, 1), dtype=np.uint8)
    write_pixels(ds, values)
    out = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    assert len(out.PixelData) == ROWS * COLS * 2
    assert np.array_equal(frames_of(out), values.astype(np.uint16))
    with pytest.raises(BurnedInAnnotationError, match="do not fit"):
        write_pixels(ds, np.full((1, ROWS, COLS, 1), -1, dtype=np.int32))


def _unconvertible(photometric: str, bits: int) -> Dataset:
    """A flagged US object whose colour pydicom cannot convert to RGB (zero samples: only the header counts)."""
    ds, _ = make_image([], rows=ROWS, cols=COLS, bg="noise", flag="YES", modality="US")
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, photometric, 0
    ds.BitsAllocated = ds.BitsStored = bits
    ds.HighBit = bits - 1
    per_pixel = {"YBR_PARTIAL_420": 1.5, "YBR_PARTIAL_422": 2, "YBR_FULL_422": 2}.get(photometric, 3)
    ds.PixelData = bytes(int(ROWS * COLS * per_pixel) * bits // 8)
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds)))


@pytest.mark.parametrize("photometric,bits", [("YBR_PARTIAL_422", 8), ("YBR_PARTIAL_420", 8),
                                              ("YBR_FULL", 16), ("YBR_FULL_422", 16)])
@pytest.mark.parametrize("mode", [CLEAN, MASKS])
def test_unconvertible_ybr_is_refused_naming_the_colour_space_and_the_way_out(
        photometric: str, bits: int, mode: dict) -> None:
    """pydicom converts only 8-bit YBR_FULL / YBR_FULL_422 to RGB; anything else is refused before
    decoding, with a message that names the photometric interpretation and bit depth and says what
    to do (16-bit YBR said 'cannot decode pixel data (...: ValueError)' and advised installing a
    decoder, which cannot help)."""
    with pytest.raises(BurnedInAnnotationError) as exc:
        Deidentifier(policy(**mode), SECRET).deidentify_dataset(_unconvertible(photometric, bits))
    message = str(exc.value)
    assert photometric in message and f"{bits}-bit" in message
    assert "8-bit YBR_FULL" in message  # what is supported
    assert "convert" in message and "RGB" in message and "allow-flagged" in message  # the way out
    assert "install" not in message and "ValueError" not in message

"""DicomDataset feeds the model what a viewer shows: PALETTE COLOR indexes go through their palette
(8- and 16-bit entries, segmented palettes, either byte order), MONOCHROME1 is inverted, and the
Modality LUT (Rescale Slope/Intercept or a Modality LUT Sequence) is applied to grey images.
Palettes that cannot be read exactly are quarantined when the index is built, naming why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
import torch
from dicom_fixtures import POLICY_DIR, SECRET, make_dataset
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_color_lut, apply_modality_lut
from pydicom.uid import ExplicitVRBigEndian

from securetrain.masking.dicom.dataset import DicomDataset

BASIC = POLICY_DIR / "dicom-basic.yaml"
COLOURS = ("Red", "Green", "Blue")


def _scaled(arr: np.ndarray) -> torch.Tensor:
    """One min/max scaling to [0, 1], as the loader does; colour [H, W, 3] -> [3, H, W]."""
    a = np.asarray(arr, dtype=np.float64)
    a = (a - a.min()) / (a.max() - a.min())
    if a.ndim == 3:
        a = a.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(a)).float()


def _grey(rgb: np.ndarray) -> torch.Tensor:
    return _scaled(np.asarray(rgb, dtype=np.float64).mean(axis=-1)).unsqueeze(0)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


def _palette_file(path: Path, lut: np.ndarray, indexes: np.ndarray, *, bits: int, first: int = 0,
                  big_endian: bool = False) -> pydicom.Dataset:
    """A PALETTE COLOR image: ``lut`` [entries, 3], ``indexes`` [8, 8] (uint8 or uint16 stored)."""
    ds = make_dataset()
    ds.PhotometricInterpretation = "PALETTE COLOR"
    ds.BitsAllocated = ds.BitsStored = indexes.dtype.itemsize * 8
    ds.HighBit = ds.BitsStored - 1
    ds.PixelData = indexes.astype(indexes.dtype.newbyteorder(">" if big_endian else "<")).tobytes()
    entry = np.dtype(f"{'>' if big_endian else '<'}u{bits // 8}")
    for i, colour in enumerate(COLOURS):
        ds.add_new(pydicom.datadict.tag_for_keyword(f"{colour}PaletteColorLookupTableDescriptor"), "US",
                   [len(lut) % 65536, first, bits])
        setattr(ds, f"{colour}PaletteColorLookupTableData", lut[:, i].astype(entry).tobytes())
    if big_endian:
        ds.file_meta.TransferSyntaxUID = ExplicitVRBigEndian
        ds.save_as(path, implicit_vr=False, little_endian=False, enforce_file_format=True)
    else:
        ds.save_as(path, enforce_file_format=True)
    return pydicom.dcmread(path)


def _testdata(name: str, folder: Path) -> Path:
    """A folder holding a copy of one of pydicom's test files that the basic policy accepts
    (burned-in text denied, a patient ID)."""
    ds = pydicom.dcmread(get_testdata_file(name))
    ds.BurnedInAnnotation = "NO"
    ds.PatientID = ds.get("PatientID") or "PID-1"
    folder.mkdir(parents=True, exist_ok=True)
    ds.save_as(folder / name)
    return folder


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("mode", ["rgb", "grey", "auto"])
def test_palette_files_are_read_through_their_palette(tmp_path: Path, bits: int, mode: str) -> None:
    rng = np.random.default_rng(bits)
    lut = rng.integers(0, 2**bits, size=(256, 3))  # not monotonic: indexes are not intensities
    indexes = rng.integers(0, 256, size=(8, 8)).astype(np.uint8)
    ds = _palette_file(tmp_path / "p.dcm", lut, indexes, bits=bits)
    truth = apply_color_lut(ds.pixel_array, ds)
    assert np.array_equal(truth, lut[indexes])  # pydicom agrees with the hand-built palette here
    data = DicomDataset(tmp_path, BASIC, SECRET, color_mode=mode)
    assert (data.colour_files, data.grey_files) == (1, 0)  # counted as colour
    assert data.color_mode == ("grey" if mode == "grey" else "rgb")
    expected = _grey(truth) if mode == "grey" else _scaled(truth)
    assert _close(data[0]["pixels"], expected)
    assert _close(data[0]["pixels"], expected)  # the cached-header path (later epochs) alike


def test_palette_and_grey_files_make_auto_grey_and_rgb_refuse_only_the_grey(tmp_path: Path) -> None:
    from securetrain.masking.dicom.errors import ColorModeError

    lut = np.stack([np.arange(256)] * 3, axis=-1)
    _palette_file(tmp_path / "a.dcm", lut, np.arange(64, dtype=np.uint8).reshape(8, 8), bits=8)
    make_dataset(sop_uid="1.2.3.4.99").save_as(tmp_path / "b.dcm", enforce_file_format=True)
    data = DicomDataset(tmp_path, BASIC, SECRET, color_mode="auto")
    assert (data.colour_files, data.grey_files, data.color_mode) == (1, 1, "grey")
    with pytest.raises(ColorModeError) as err:
        DicomDataset(tmp_path, BASIC, SECRET, color_mode="rgb")
    assert err.value.path == "b.dcm"


@pytest.mark.parametrize("name", ["OBXXXX1A.dcm", "OBXXXX1A_expb.dcm", "OBXXXX1A_rle.dcm"])
def test_pydicom_palette_files_in_either_byte_order(tmp_path: Path, name: str) -> None:
    """16-bit palette entries: the big endian copy gives the same RGB as the little endian one
    (pydicom's apply_color_lut reads big endian palette data byte-swapped)."""
    reference = pydicom.dcmread(get_testdata_file("OBXXXX1A.dcm"))
    truth = apply_color_lut(reference.pixel_array, reference)
    data = DicomDataset(_testdata(name, tmp_path / "in"), BASIC, SECRET, color_mode="rgb")
    assert _close(data[0]["pixels"], _scaled(truth))


@pytest.mark.parametrize("name", ["gdcm-US-ALOKA-16.dcm", "gdcm-US-ALOKA-16_big.dcm"])
def test_segmented_palettes(tmp_path: Path, name: str) -> None:
    reference = pydicom.dcmread(get_testdata_file("gdcm-US-ALOKA-16.dcm"))
    truth = apply_color_lut(reference.pixel_array, reference)
    data = DicomDataset(_testdata(name, tmp_path / "in"), BASIC, SECRET, color_mode="rgb")
    assert data.colour_files == 1 and not data.quarantine_report()
    assert _close(data[0]["pixels"], _scaled(truth))


def test_big_endian_plain_palette_file_built_here(tmp_path: Path) -> None:
    lut = np.random.default_rng(3).integers(0, 65536, size=(256, 3))
    indexes = np.arange(64, dtype=np.uint8).reshape(8, 8)
    _palette_file(tmp_path / "p.dcm", lut, indexes, bits=16, big_endian=True)
    data = DicomDataset(tmp_path, BASIC, SECRET, color_mode="rgb")
    assert _close(data[0]["pixels"], _scaled(lut[indexes]))


def test_indexes_past_the_palette_take_its_last_entry(tmp_path: Path) -> None:
    """16-bit indexes, an 8-bit palette of 1024 entries starting at 4: values below the first mapped
    value take entry 0, values past the end the last entry (PS3.3 C.7.6.3.1.5); nothing wraps."""
    lut = np.random.default_rng(5).integers(0, 256, size=(1024, 3))
    indexes = np.array([0, 3, 4, 255, 256, 300, 1027, 1028, 5000, 65535] + [600] * 54, dtype=np.uint16).reshape(8, 8)
    _palette_file(tmp_path / "p.dcm", lut, indexes, bits=8, first=4)
    expected = lut[np.clip(indexes.astype(np.int64) - 4, 0, 1023)]
    data = DicomDataset(tmp_path, BASIC, SECRET, color_mode="rgb")
    assert _close(data[0]["pixels"], _scaled(expected))


def _broken(ds: pydicom.Dataset, how: str) -> None:
    if how == "12-bit entries":
        for colour in COLOURS:
            ds[f"{colour}PaletteColorLookupTableDescriptor"].value = [256, 0, 12]
    elif how == "short data":
        for colour in COLOURS:
            ds[f"{colour}PaletteColorLookupTableData"].value = ds[f"{colour}PaletteColorLookupTableData"].value[:100]
    elif how == "descriptors differ":
        ds.BluePaletteColorLookupTableDescriptor = [128, 0, 8]
    elif how == "no data":
        del ds.RedPaletteColorLookupTableData
    elif how == "segmented 8-bit":
        for colour in COLOURS:
            del ds[f"{colour}PaletteColorLookupTableData"]
            setattr(ds, f"Segmented{colour}PaletteColorLookupTableData", bytes([0, 2, 0, 255]))


@pytest.mark.parametrize(("how", "says"), [
    ("12-bit entries", "12-bit palette entries"),
    ("short data", "100 bytes"),
    ("descriptors differ", "descriptors differ"),
    ("no data", "palette data"),
    ("segmented 8-bit", "segmented palette with 8-bit entries"),
])
def test_palettes_that_cannot_be_read_exactly_are_quarantined_up_front(tmp_path: Path, how: str, says: str) -> None:
    lut = np.stack([np.arange(256)] * 3, axis=-1)
    ds = _palette_file(tmp_path / "p.dcm", lut, np.arange(64, dtype=np.uint8).reshape(8, 8), bits=8)
    _broken(ds, how)
    ds.save_as(tmp_path / "p.dcm")
    data = DicomDataset(tmp_path, BASIC, SECRET, color_mode="auto")
    assert len(data) == 0
    [entry] = data.quarantine_report()
    assert "PALETTE COLOR" in entry["reason"] and says in entry["reason"], entry["reason"]


def test_palette_error_is_typed() -> None:
    from securetrain.masking.dicom.colour import palette
    from securetrain.masking.dicom.errors import DeidError, PaletteColorError

    ds = make_dataset()
    ds.PhotometricInterpretation = "PALETTE COLOR"
    with pytest.raises(PaletteColorError) as err:
        palette(ds)
    assert isinstance(err.value, DeidError) and err.value.hint


def test_the_ocr_view_uses_the_same_palette(tmp_path: Path) -> None:
    """burned_in's 8-bit view reads palettes through the same helper: big endian alike."""
    from securetrain.masking.dicom.burned_in.codec import decode_frames, displayed

    little = pydicom.dcmread(get_testdata_file("OBXXXX1A.dcm"))
    big = pydicom.dcmread(get_testdata_file("OBXXXX1A_expb.dcm"))
    assert np.array_equal(displayed(big, decode_frames(big)), displayed(little, decode_frames(little)))
    assert np.array_equal(displayed(little, decode_frames(little))[0], apply_color_lut(little.pixel_array, little))


def test_monochrome1_is_inverted(tmp_path: Path) -> None:
    """MONOCHROME1 shows low values bright: the model gets what a viewer shows."""
    ds = make_dataset()
    ds.PhotometricInterpretation = "MONOCHROME1"
    ds.save_as(tmp_path / "m1.dcm", enforce_file_format=True)
    raw = np.arange(64, dtype=np.float64).reshape(8, 8)
    data = DicomDataset(tmp_path, BASIC, SECRET)
    assert _close(data[0]["pixels"], _scaled(raw.max() - raw).unsqueeze(0))
    assert data[0]["pixels"][0, 0, 0] == 1.0  # stored 0 is white


def test_pydicom_monochrome1_file(tmp_path: Path) -> None:
    ds = pydicom.dcmread(get_testdata_file("RG1_UNCI.dcm"))
    raw = apply_modality_lut(ds.pixel_array, ds).astype(np.float64)
    data = DicomDataset(_testdata("RG1_UNCI.dcm", tmp_path / "in"), BASIC, SECRET)
    assert _close(data[0]["pixels"], _scaled(-raw).unsqueeze(0))


def test_modality_lut_sequence_is_applied(tmp_path: Path) -> None:
    ds = pydicom.dcmread(get_testdata_file("mlut_18.dcm"))
    truth = apply_modality_lut(ds.pixel_array, ds)
    data = DicomDataset(_testdata("mlut_18.dcm", tmp_path / "in"), BASIC, SECRET)
    assert not data.quarantine_report()
    assert _close(data[0]["pixels"], _scaled(truth).unsqueeze(0))
    assert _close(data[0]["pixels"], _scaled(truth).unsqueeze(0))  # cached header


def test_a_non_linear_modality_lut_built_here(tmp_path: Path) -> None:
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    ds = make_dataset()
    item = Dataset()
    item.add_new(0x00283002, "US", [64, 0, 16])  # LUT Descriptor: 64 entries from stored value 0
    table = ((np.arange(64) - 40) ** 2).astype(np.uint16)  # falls, then rises: min-max cannot undo it
    item.add_new(0x00283006, "US", table.tolist())  # LUT Data
    item.ModalityLUTType = "OD"
    ds.ModalityLUTSequence = Sequence([item])
    ds.save_as(tmp_path / "lut.dcm", enforce_file_format=True)
    data = DicomDataset(tmp_path, BASIC, SECRET)
    expected = table[np.arange(64).reshape(8, 8)]
    assert _close(data[0]["pixels"], _scaled(expected).unsqueeze(0))


def test_a_modality_lut_shorter_than_its_descriptor_is_quarantined(tmp_path: Path) -> None:
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    ds = make_dataset()
    item = Dataset()
    item.add_new(0x00283002, "US", [64, 0, 16])
    item.add_new(0x00283006, "US", list(range(10)))
    ds.ModalityLUTSequence = Sequence([item])
    ds.save_as(tmp_path / "lut.dcm", enforce_file_format=True)
    data = DicomDataset(tmp_path, BASIC, SECRET)
    [entry] = data.quarantine_report()
    assert "Modality LUT" in entry["reason"] and "10 entries" in entry["reason"]


def test_pipeline_frames_read_palettes_too(tmp_path: Path) -> None:
    """The pipeline's all-frames loader (FramesDicomDataset) applies the palette to every frame."""
    from securetrain.pipeline.tasks.dicom import FramesDicomDataset

    reference = pydicom.dcmread(get_testdata_file("OBXXXX1A_2frame.dcm"))
    truth = apply_color_lut(reference.pixel_array, reference)  # [2, H, W, 3]
    data = FramesDicomDataset(_testdata("OBXXXX1A_2frame.dcm", tmp_path / "in"), BASIC, SECRET, frames="all", color_mode="rgb")
    pixels = data[0]["pixels"]
    a = truth.astype(np.float64)
    a = (a - a.min()) / (a.max() - a.min())
    expected = torch.from_numpy(a.transpose(0, 3, 1, 2).reshape(6, *a.shape[1:3]).copy()).float()
    assert _close(pixels, expected)


def test_a_zero_rescale_slope_is_quarantined_not_trained_as_a_blank_image(tmp_path: Path) -> None:
    """Rescale Slope 0 maps every stored value to the intercept: the item was an all-zero image,
    trained on without a word. It is a data error (the viewer shows nothing either)."""
    ds = make_dataset()
    ds.RescaleSlope, ds.RescaleIntercept = "0", "-1024"
    ds.save_as(tmp_path / "zero.dcm", enforce_file_format=True)
    ds.RescaleSlope = "1"
    ds.save_as(tmp_path / "one.dcm", enforce_file_format=True)
    data = DicomDataset(tmp_path, BASIC, SECRET)
    assert [Path(p).name for p, _ in data.items] == ["one.dcm"]
    [entry] = data.quarantine_report()
    assert entry == {"path": "zero.dcm", "reason": "RescaleSlope is 0: every pixel would show the same value"}

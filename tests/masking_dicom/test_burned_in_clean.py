"""burned_in: clean with real Tesseract on synthetic US/SC frames with rendered PHI text.

For every case: all legible text pixels lie inside the masked regions, pixels outside the masks
are unchanged, none of the rendered strings survives OCR of the output, and the output re-reads
as valid DICOM with BurnedInAnnotation=NO and the masked regions recorded."""

from __future__ import annotations

import io
import os
import re
import shutil

import numpy as np
import pydicom
import pytest
from burned_in_helpers import Text, frames_of, make_image, normalise, ocr_text, region_map
from dicom_fixtures import SECRET

from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import BurnedInAnnotationError
from securetrain.masking.dicom.policy import load_policy

pytestmark = [
    pytest.mark.skipif(shutil.which("tesseract") is None, reason="needs the tesseract-ocr package (.ci/run installs it)"),
    pytest.mark.slow,
]

NAME, MRN, DATE = "DOE^JOHN", "MRN 84412977", "2023-04-05"


def clean_policy(**ocr: object):
    data = {"policy_version": 1, "name": "ocr-test", "profile": "basic", "burned_in": "clean"}
    if ocr:
        data["burned_in_ocr"] = ocr
    return load_policy(data=data)


def tokens(texts: list[Text]) -> set[str]:
    out = set()
    for t in texts:
        out |= {normalise(p) for p in re.split(r"[^A-Za-z0-9]+", t.text) if len(p) >= 4}
        out.add(normalise(t.text))
    return out


def clean(ds: pydicom.Dataset) -> tuple[pydicom.Dataset, object, Deidentifier]:
    deid = Deidentifier(clean_policy(), SECRET)
    _, report = deid.deidentify_dataset(ds)
    return pydicom.dcmread(io.BytesIO(encode_dataset(ds))), report, deid


def check_clean(texts: list[Text], ds: pydicom.Dataset, ink: np.ndarray) -> pydicom.Dataset:
    before = frames_of(ds).copy()
    rows, cols = before.shape[1:3]
    phi = tokens(texts)
    assert phi & set(_found(ocr_text(ds), phi)), "the input must carry OCR-readable PHI, or this test proves nothing"
    out, report, deid = clean(ds)
    detail = report.burned_in_detail
    assert report.burned_in == "cleaned" and detail.action == "cleaned" and detail.regions
    cover = region_map(detail.regions, rows, cols)
    assert not (ink & ~cover[None]).any(), f"{int((ink & ~cover[None]).sum())} text pixels outside the masks"
    after = frames_of(out)
    assert after.shape == before.shape
    outside = np.broadcast_to(~cover[None, :, :, None], before.shape)
    assert np.array_equal(after[outside], before[outside]), "pixels outside the masks changed"
    black = 0 if before.shape[-1] == 3 else before.min()
    assert (after[np.broadcast_to(cover[None, :, :, None], before.shape)] == black).all()
    assert _found(ocr_text(out), phi) == [], "PHI still readable by OCR in the output"
    assert out.BurnedInAnnotation == "NO"
    assert sum(v.startswith("masked ocr (") for v in out.DeidentificationMethod) >= 1
    assert "113101" in {i.CodeValue for i in out.DeidentificationMethodCodeSequence}
    assert deid.burned_in.counts.cleaned == 1 and deid.burned_in.counts.refused == 0
    record = repr(report.to_dict()) + repr(list(out.DeidentificationMethod))
    # Value by value: normalising the whole record ran numbers together ("(20, 23" -> "2023"), so
    # region coordinates read as the year of the planted date when OCR's boxes fell that way.
    values = [normalise(v) for v in re.split(r"[,'\"()\[\]{}:]+", record)]
    assert not [p for p in phi if any(p in v for v in values)], "recognised text leaked into the record"
    return out


def _found(text: str, phi: set[str]) -> list[str]:
    return sorted(p for p in phi if p in text)


CASES = {
    "us-gradient-sizes": dict(texts=[Text(NAME, 6, 4, 11), Text(MRN, 6, 20, 13, 0.8), Text(DATE, 200, 4, 16, 0.9)],
                              bg="gradient"),
    "us-speckle-header": dict(texts=[Text(NAME, 8, 6, 14), Text(DATE, 190, 6, 14, 0.8), Text(MRN, 170, 215, 18)],
                              bg="speckle"),
    "us-noise-large-and-dark": dict(texts=[Text("JANE ROE", 20, 100, 28), Text("ID 55120334", 150, 200, 20, 0.7)],
                                    bg="noise"),
    "sc-dark-text-on-light": dict(texts=[Text("PATEL^RAJ", 10, 10, 16, -0.9), Text("19700101", 10, 40, 14, -0.8)],
                                  bg="flat-light", modality="SC"),
    "sc-rgb": dict(texts=[Text(NAME, 10, 10, 15), Text("ACC 99812", 150, 120, 20, 0.85)], bg="noise", modality="SC",
                   rgb=True),
    "us-rgb-yellow-text": dict(texts=[Text(NAME, 10, 8, 15), Text("ID 55120334", 120, 210, 16)], bg="speckle",
                               rgb=True, colour=(1.0, 1.0, 0.0)),
    "us-16bit": dict(texts=[Text("SMITH^ANNA", 12, 12, 16, 1.0), Text(DATE, 180, 200, 14, 0.9)], bg="gradient", bits=16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_phi_is_masked_and_unreadable(case: str) -> None:
    spec = dict(CASES[case])
    texts = spec.pop("texts")
    if spec.get("bg") == "flat-light":
        spec["bg"] = "flat"
        ds, ink = make_image(texts, seed=3, **spec)
        # light page: invert the background, keep the dark text
        arr = frames_of(ds)
        ds.PixelData = np.where(ink[..., None], arr, 230).astype(np.uint8).tobytes()
    else:
        ds, ink = make_image(texts, seed=3, **spec)
    check_clean(texts, ds, ink)


def test_multiframe_static_and_moving_text_masked_in_every_frame() -> None:
    texts = [Text(NAME, 6, 6, 14), Text(DATE, 190, 6, 14, 0.85)]
    moving = [Text("MRN84412977", 40, 200, 16)]
    ds, ink = make_image(texts, moving_texts=moving, frames=3, bg="speckle", seed=5)
    out = check_clean(texts + moving, ds, ink)
    assert int(out.NumberOfFrames) == 3


def test_text_free_image_is_passed_unchanged() -> None:
    ds, _ = make_image([], bg="speckle", seed=9)
    pixels = ds.PixelData
    out, report, _ = clean(ds)
    assert out.PixelData == pixels and report.burned_in_detail.regions == [] and out.BurnedInAnnotation == "NO"


def test_text_covering_the_image_is_refused_with_reason() -> None:
    lines = [Text(f"PATIENT DOE JOHN {i:02d} MRN 84412977", 2, 2 + 22 * i, 18) for i in range(11)]
    ds, _ = make_image(lines, bg="flat", seed=1, cols=360)
    deid = Deidentifier(clean_policy(), SECRET)
    with pytest.raises(BurnedInAnnotationError, match="covers too much of the image"):
        deid.deidentify_dataset(ds)
    assert deid.burned_in.counts.refused == 1 and deid.burned_in.counts.cleaned == 0


@pytest.mark.parametrize(
    "name,words",
    [
        ("gdcm-US-ALOKA-16.dcm", ["WESTWAY", "MEDICAL", "ULTRASOUND", "24MAY02", "PELVIS"]),  # PALETTE COLOR
        ("US1_UNCR.dcm", ["BAPTIST", "MSCSKEL", "LYMPH"]),  # RGB, text on black around colour Doppler
    ],
)
def test_real_ultrasound_annotations_are_removed(name: str, words: list[str]) -> None:
    import warnings

    import pytesseract
    from PIL import Image
    from pydicom.data import get_testdata_file
    from pydicom.pixels import apply_color_lut

    def shown(ds: pydicom.Dataset) -> np.ndarray:
        arr = ds.pixel_array
        if ds.PhotometricInterpretation == "PALETTE COLOR":
            arr = apply_color_lut(arr, ds)
        return arr.astype(np.float32).max(axis=-1) if arr.ndim == 3 else arr.astype(np.float32)

    def read(ds: pydicom.Dataset) -> str:
        gray = shown(ds)
        img = Image.fromarray((255 * (gray - gray.min()) / max(1.0, float(gray.max() - gray.min()))).astype(np.uint8))
        big = img.resize((img.width * 2, img.height * 2), Image.Resampling.BICUBIC)
        return normalise(pytesseract.image_to_string(big, config="--psm 11"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = pydicom.dcmread(get_testdata_file(name))
        before = read(ds)
        assert [w for w in words if w in before], "the input's annotation must be readable, or this proves nothing"
        out, report, _ = clean(ds)
        after = read(out)
    assert report.burned_in == "cleaned" and out.BurnedInAnnotation == "NO"
    assert [w for w in words if w in after] == []


def test_ocr_limits_threads_of_tesseract_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # OMP_THREAD_LIMIT=1 in our own environment reached torch and every child process: a later
    # backward pass hung in OpenMP (the packaged demo timed out after OCR tests ran in the same session).
    from securetrain.masking.dicom.burned_in.ocr import TesseractEngine

    monkeypatch.delenv("OMP_THREAD_LIMIT", raising=False)
    engine = TesseractEngine()
    assert engine.read([np.full((64, 256), 255, np.uint8)]) == [[]]
    assert "OMP_THREAD_LIMIT" not in os.environ

"""Policy option burned_in (reject | clean | allow-flagged) and known_regions: validation, defaults,
and the cleaner's decisions with a scripted OCR engine (no Tesseract needed)."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pydicom
import pytest
from burned_in_helpers import ScriptedEngine, Text, frames_of, make_image, policy
from dicom_fixtures import POLICY_DIR, SECRET

from securetrain.errors import ConfigError
from securetrain.masking.dicom.burned_in.cleaner import BurnedInCleaner
from securetrain.masking.dicom.burned_in.ocr import Word
from securetrain.masking.dicom.engine import Deidentifier, encode_dataset
from securetrain.masking.dicom.errors import BurnedInAnnotationError
from securetrain.masking.dicom.policy import load_policy


def test_defaults_keep_reject_for_existing_policies() -> None:
    for f in sorted(POLICY_DIR.glob("dicom-*.yaml")):
        pol = load_policy(f)
        assert pol.burned_in == "reject" and pol.known_regions == ()


@pytest.mark.parametrize(
    "change,field",
    [
        ({"burned_in": "ocr"}, "burned_in"),
        ({"burned_in": "clean", "burned_in_annotation": "mask", "options": ["clean_pixel_data"],
          "pixel_masks": [{"rects": [[0, 0, 1, 1]]}]}, "burned_in_annotation"),
        ({"known_regions": [{"manufacturer": "ACME", "rects": [[0, 0, 5, 5]]}]}, "known_regions"),
        ({"burned_in": "clean", "known_regions": [{"rects": [[0, 0, 5, 5]]}]}, "at least one of"),
        ({"burned_in": "clean", "known_regions": [{"rows": 10, "rects": [[5, 0, 5, 5]]}]}, "rectangle"),
        ({"burned_in": "clean", "known_regions": [{"rows": 10, "rects": [[0, 0, 5, 5]], "label": "x" * 30}]}, "label"),
        ({"burned_in": "clean", "burned_in_ocr": {"margin": -1}}, "margin"),
        ({"burned_in": "clean", "burned_in_ocr": {"max_masked_fraction": 0}}, "max_masked_fraction"),
        ({"burned_in": "clean", "burned_in_ocr": {"colour": 1}}, "colour"),
    ],
)
def test_invalid_burned_in_settings_are_one_config_error(change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        policy(**change)
    assert field in str(err.value)


def test_env_override_selects_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECURETRAIN_DEID_POLICY__BURNED_IN", "allow-flagged")
    assert load_policy(POLICY_DIR / "dicom-basic.yaml").burned_in == "allow-flagged"


def test_digest_covers_burned_in_mode() -> None:
    assert policy().digest != policy(burned_in="clean").digest


def test_reject_is_default_and_unchanged() -> None:
    ds, _ = make_image([Text("DOE^JOHN", 5, 5)])
    deid = Deidentifier(policy(), SECRET)
    with pytest.raises(BurnedInAnnotationError, match="burned-in annotation \\(flagged\\)"):
        deid.deidentify_dataset(ds)
    assert deid.burned_in.counts.refused == 1 and deid.burned_in.counts.cleaned == 0


def test_allow_flagged_passes_pixels_and_flag_and_records_it() -> None:
    ds, _ = make_image([Text("DOE^JOHN", 5, 5)])
    pixels = ds.PixelData
    deid = Deidentifier(policy(burned_in="allow-flagged", options=["clean_pixel_data"]), SECRET)
    _, report = deid.deidentify_dataset(ds)
    out = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    assert out.PixelData == pixels and out.BurnedInAnnotation == "YES"
    assert report.burned_in == "allowed-flagged" and report.to_dict()["burned_in_detail"]["action"] == "allowed-flagged"
    assert any("NOT removed" in v for v in out.DeidentificationMethod)
    # 113101 (Clean Pixel Data) is not claimed for pixels that were not cleaned
    assert "113101" not in {i.CodeValue for i in out.DeidentificationMethodCodeSequence}
    assert deid.burned_in.counts.allowed_flagged == 1


def test_allow_flagged_keeps_suspected_files_unflagged() -> None:
    ds, _ = make_image([Text("DOE^JOHN", 5, 5)], flag=None)
    deid = Deidentifier(policy(burned_in="allow-flagged"), SECRET)
    deid.deidentify_dataset(ds)
    assert "BurnedInAnnotation" not in ds  # never claimed NO: nothing was checked


def test_known_regions_are_masked_without_ocr() -> None:
    ds, _ = make_image([], flag="NO", manufacturer="Acme Imaging Inc", rows=64, cols=80, bg="noise")
    before = frames_of(ds).copy()
    engine = ScriptedEngine([Word("SHOULD-NOT-BE-ASKED", 99, 0, 0, 5, 5)])
    pol = policy(burned_in="clean", known_regions=[
        {"manufacturer": "acme imaging", "rows": 64, "columns": 80, "rects": [[0, 0, 80, 10]], "label": "banner"},
        {"manufacturer": "OtherVendor", "rects": [[0, 50, 80, 64]]},
        {"manufacturer": "acme", "rows": 65, "rects": [[0, 20, 80, 30]]},
    ])
    cleaner = BurnedInCleaner(pol, engine=engine)
    outcome = cleaner.process(ds)
    after = frames_of(ds)
    assert engine.calls == 0  # BurnedInAnnotation=NO: known regions only, no OCR
    assert (after[:, :10] == before.min()).all() and np.array_equal(after[:, 10:], before[:, 10:])
    assert outcome.action == "masked" and [r.label for r in outcome.regions] == ["banner"]
    assert cleaner.counts.masked == 1


def test_text_that_stays_after_masking_is_refused_with_reason() -> None:
    ds, _ = make_image([Text("DOE^JOHN", 5, 5, 16)], bg="flat")
    pixels = ds.PixelData
    # An OCR that keeps "reading" text wherever it looks: masking never converges.
    engine = ScriptedEngine([Word("PATIENT", 95, 12, 12, 30, 12)])
    cleaner = BurnedInCleaner(policy(burned_in="clean", burned_in_ocr={"full_frame": True}), engine=engine)
    with pytest.raises(BurnedInAnnotationError, match="text still found by OCR after masking"):
        cleaner.process(ds)
    assert ds.PixelData == pixels and ds.BurnedInAnnotation == "YES"  # nothing half-written
    assert cleaner.counts.refused == 1 and cleaner.counts.refusal_reasons == {"text still found": 1}


def test_too_many_frames_are_refused() -> None:
    ds, _ = make_image([], frames=3, moving_texts=[Text("X1", 5, 5)], rows=32, cols=48, bg="flat")
    pol = policy(burned_in="clean", burned_in_ocr={"max_frames": 2})
    with pytest.raises(BurnedInAnnotationError, match="too many distinct frames"):
        BurnedInCleaner(pol, engine=ScriptedEngine()).process(ds)


@pytest.mark.skipif(shutil.which("tesseract") is None, reason="needs the tesseract-ocr package (.ci/run installs it)")
def test_clean_without_text_keeps_pixel_bytes_and_clears_flag() -> None:
    ds, _ = make_image([], bg="noise", rows=48, cols=64)
    pixels = ds.PixelData
    deid = Deidentifier(policy(burned_in="clean"), SECRET)
    deid.burned_in.engine = ScriptedEngine()
    _, report = deid.deidentify_dataset(ds)
    out = pydicom.dcmread(io.BytesIO(encode_dataset(ds)))
    assert out.PixelData == pixels and out.BurnedInAnnotation == "NO"
    assert report.burned_in == "cleaned" and not report.pixels_masked
    assert "113101" in {i.CodeValue for i in out.DeidentificationMethodCodeSequence}
    assert any(v.startswith("burned-in text: OCR-verified clean") for v in out.DeidentificationMethod)
    assert deid.burned_in.counts.to_dict()["cleaned"] == 1


def test_missing_tesseract_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.masking.dicom.burned_in import cleaner as cleaner_mod
    from securetrain.masking.dicom.burned_in.ocr import OcrUnavailableError

    def unavailable(*_a: object, **_k: object) -> None:
        raise OcrUnavailableError("the tesseract program cannot run")

    monkeypatch.setattr(cleaner_mod, "TesseractEngine", unavailable)
    with pytest.raises(ConfigError, match="burned_in: clean but OCR is unavailable"):
        Deidentifier(policy(burned_in="clean"), SECRET)
    Deidentifier(policy(), SECRET)  # reject / allow-flagged never need OCR


def test_monochrome1_is_masked_with_its_black_and_signed_data_with_its_minimum() -> None:
    ds, _ = make_image([], flag="NO", rows=40, cols=50, bg="noise", bits=16)
    ds.PhotometricInterpretation = "MONOCHROME1"
    pol = policy(burned_in="clean", known_regions=[{"rows": 40, "rects": [[0, 0, 50, 8]]}])
    before = frames_of(ds).copy()
    BurnedInCleaner(pol, engine=ScriptedEngine()).process(ds)
    after = frames_of(ds)
    assert (after[:, :8] == before.max()).all() and np.array_equal(after[:, 8:], before[:, 8:])

    signed, _ = make_image([], flag="NO", rows=40, cols=50, bg="noise", bits=16)
    values = frames_of(signed).astype(np.int16) - 2048
    signed.PixelRepresentation = 1
    signed.PixelData = values.tobytes()
    BurnedInCleaner(pol, engine=ScriptedEngine()).process(signed)
    assert (frames_of(signed)[:, :8] == values.min()).all() and values.min() < 0


def test_one_bit_and_undecodable_pixels_are_refused_with_reason() -> None:
    ds, _ = make_image([], rows=16, cols=16, bg="flat")
    ds.BitsAllocated = ds.BitsStored = 1
    ds.HighBit = 0
    ds.PixelData = b"\x00" * 32
    with pytest.raises(BurnedInAnnotationError, match="1-bit"):
        BurnedInCleaner(policy(burned_in="clean"), engine=ScriptedEngine()).process(ds)
    broken, _ = make_image([], rows=16, cols=16, bg="flat")
    broken.PixelData = broken.PixelData[:100]  # shorter than Rows x Columns
    with pytest.raises(BurnedInAnnotationError, match="cannot decode pixel data|shape"):
        BurnedInCleaner(policy(burned_in="clean"), engine=ScriptedEngine()).process(broken)


def test_records_hold_coordinates_never_text() -> None:
    ds, _ = make_image([Text("DOE^JOHN", 5, 5, 16)], bg="flat", rows=64, cols=96)
    engine = ScriptedEngine([Word("DOEJOHN", 90, 14, 14, 60, 20)])
    pol = policy(burned_in="clean", burned_in_ocr={"full_frame": True, "rounds": 1})
    deid = Deidentifier(pol, SECRET)
    deid.burned_in.engine = engine
    with pytest.raises(BurnedInAnnotationError) as err:
        deid.deidentify_dataset(ds)
    assert "DOE" not in str(err.value) and "JOHN" not in str(err.value)
    assert "DOE" not in repr(deid.burned_in.counts.to_dict())


def test_identical_frames_are_read_once_and_masks_reach_every_frame() -> None:
    ds, _ = make_image([Text("DOE^JOHN 84412977", 4, 4, 14)], frames=4, rows=48, cols=160, bg="flat")
    arr = frames_of(ds)
    ds.PixelData = np.repeat(arr[:1], 4, axis=0).tobytes()  # a still cine loop: 4 equal frames
    seen: list[int] = []

    class Once(ScriptedEngine):
        def read(self, images: list[np.ndarray]) -> list[list[Word]]:
            seen.append(len(images))
            return [[Word("DOEJOHN84412977", 90, 5, 5, 40, 10)] if len(seen) == 1 else [] for _ in images]

    pol = policy(burned_in="clean", burned_in_ocr={"full_frame": True})
    outcome = BurnedInCleaner(pol, engine=Once()).process(ds)
    assert outcome.frames_checked == 1 and outcome.regions
    after = frames_of(ds)
    for r in outcome.regions:  # the same boxes are black in all four frames
        assert (after[:, r.y0 : r.y1, r.x0 : r.x1] == arr.min()).all()


class _TextOnFirstRead(ScriptedEngine):
    """Reads a word on its first call only: text that masking removes."""

    def read(self, images: list[np.ndarray]) -> list[list[Word]]:
        self.calls += 1
        return [[Word("DOEJOHN", 90, 4, 4, 30, 10)] if self.calls == 1 else [] for _ in images]


@pytest.mark.parametrize("modality, verified", [("US", True), ("SC", True), ("CT", False)])
def test_verify_declared_no_ocrs_flagged_no_files_of_suspect_modalities(modality: str, verified: bool) -> None:
    """Burned In Annotation NO is the writer's claim. With burned_in_ocr.verify_declared_no a file
    of a modality that usually burns text in is OCR'd and cleaned all the same; other modalities
    keep being trusted. Before, a NO file was never OCR'd, whatever the policy said."""
    ds, _ = make_image([], flag="NO", modality=modality, rows=48, cols=64, bg="noise")
    if modality == "CT":  # the SOP class agrees (the renderer writes Ultrasound's or SC's)
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    before = frames_of(ds).copy()
    engine = _TextOnFirstRead()
    cleaner = BurnedInCleaner(policy(burned_in="clean", burned_in_ocr={"verify_declared_no": True}), engine=engine)
    outcome = cleaner.process(ds)
    after = frames_of(ds)
    if verified:
        assert engine.calls >= 2 and outcome.action == "cleaned" and outcome.regions
        box = outcome.regions[0]
        assert (after[:, box.y0:box.y1, box.x0:box.x1] == before.min()).all()
        assert outcome.status == "no"  # what the file declared, reported as such
    else:
        assert engine.calls == 0 and outcome.action == "none" and np.array_equal(after, before)
    assert ds.BurnedInAnnotation == "NO"


def test_declared_no_is_trusted_by_default() -> None:
    ds, _ = make_image([], flag="NO", modality="US", rows=48, cols=64, bg="noise")
    pixels = ds.PixelData
    engine = _TextOnFirstRead()
    outcome = BurnedInCleaner(policy(burned_in="clean"), engine=engine).process(ds)
    assert engine.calls == 0 and outcome.action == "none" and ds.PixelData == pixels

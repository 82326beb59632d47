"""De-identified files the training loader cannot use are refused like quarantined inputs.

De-identification writes header-only objects (no Rows/Columns: e.g. the stripped images a
DICOMDIR references) and files whose pixels no installed decoder reads; the training
``DicomDataset`` then leaves them out of its index. Before, the pipeline trained on the rest
without a word: pydicom's DICOMDIR test tree (50 header-only objects of 85 written) trained on
10 of 60 training files while the run reported "85/92 files" and completed."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.masking.dicom.errors import REFUSED_FILES_EXIT_CODE, RefusedFilesError
from securetrain.pipeline import stages
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.secrets import load_run_secrets

from .pipeline_fixtures import grey_dicom, small_config_data


def _header_only(path: Path, *, seed: int) -> None:
    """A valid MR object without its Image Pixel module (what a DICOMDIR's stripped images look like)."""
    import pydicom

    grey_dicom(path, seed=seed)
    ds = pydicom.dcmread(path)
    for keyword in ("PixelData", "Rows", "Columns", "BitsAllocated", "BitsStored", "HighBit",
                    "PixelRepresentation", "SamplesPerPixel", "PhotometricInterpretation"):
        if keyword in ds:
            delattr(ds, keyword)
    ds.save_as(path, enforce_file_format=True)


def _config(tmp_path: Path, **data: object):
    folder = tmp_path / "site"
    folder.mkdir()
    rows = []
    for i in range(8):
        name = f"img{i}.dcm"
        (_header_only if i == 5 else grey_dicom)(folder / name, seed=200 + i)
        rows.append((name, i % 2))
    manifest = folder / "labels.csv"
    with manifest.open("w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows([("path", "label"), *rows])
    cfg = small_config_data(tmp_path, name="unusable", data={"source": str(manifest), **data},
                            he={"enabled": False})
    cfg["data"].pop("synthetic")
    return load_pipeline_config(data=cfg)


def _datasets(config):  # noqa: ANN001, ANN202
    audit = MemoryAuditRecorder()
    secrets = load_run_secrets(config)
    summary = stages.deidentify(config, stages.ingest(config), secrets, audit)
    assert summary.files_out == 8 and summary.quarantined == 0  # de-identification wrote every file
    return stages.task_datasets(config, secrets, audit), audit.events


def test_files_the_loader_cannot_use_fail_the_run_naming_their_rows(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with pytest.raises(RefusedFilesError) as err:
        _datasets(config)
    message = str(err.value)
    assert err.value.exit_code == REFUSED_FILES_EXIT_CODE
    assert "1 of 8 de-identified files cannot be used for training" in message
    assert "manifest data row 6 (de-identified as 000005.dcm): no image (Rows/Columns absent)" in message
    assert "data.allow_quarantine" in (err.value.hint or "")
    assert "img5" not in message  # rows and sequence numbers, never input paths


def test_accepted_unusable_files_are_counted_logged_and_audited(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    config = _config(tmp_path, allow_quarantine=True)
    with caplog.at_level(logging.WARNING, logger="securetrain.pipeline"):
        (_, data), events = _datasets(config)
    assert len(data.train) + len(data.eval) == 7
    assert data.inputs["unusable_files"] == 1
    assert data.inputs["unusable_reasons"] == {"no image (Rows/Columns absent)": 1}
    [warning] = [r for r in caplog.records if "cannot be used for training" in r.getMessage()]
    assert "manifest data row 6" in warning.getMessage()
    [event] = [e for e in events if e["action"] == "data.unusable"]
    assert event["details"] == {"files": 8, "unusable": 1, "accepted": True}


def test_files_dropped_while_training_are_counted_and_logged(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A file that passes the index but fails on every load (a corrupt JPEG 2000 stream: a decoder is
    installed, the bytes are bad) is dropped from each batch; the run said nothing about it."""
    import json

    import pydicom
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEG2000Lossless

    from securetrain.pipeline.runner import run_pipeline

    config = _config(tmp_path)
    source = Path(config.data.source).parent
    bad = pydicom.dcmread(source / "img5.dcm")  # the header-only one: give it a corrupt stream
    bad.Rows = bad.Columns = 16
    bad.SamplesPerPixel, bad.PhotometricInterpretation = 1, "MONOCHROME2"
    bad.BitsAllocated, bad.BitsStored, bad.HighBit, bad.PixelRepresentation = 16, 16, 15, 0
    bad.file_meta.TransferSyntaxUID = JPEG2000Lossless
    bad.PixelData = encapsulate([b"\xff\x4f\xff\x51" + b"\x00" * 60])
    bad["PixelData"].VR = "OB"
    bad.save_as(source / "img5.dcm", enforce_file_format=True)
    with caplog.at_level(logging.WARNING, logger="securetrain.pipeline"):
        run_pipeline(config)
    inputs = json.loads((config.run_dir / "result.json").read_text())["training"]["inputs"]
    assert inputs["dropped_at_load"] == 1 and "unusable_files" not in inputs
    [warning] = [r.getMessage() for r in caplog.records if "dropped while loading" in r.getMessage()]
    assert "manifest data row 6 (de-identified as 000005.dcm): cannot decode pixel data (JPEG 2000" in warning

"""Colour DICOM (ultrasound, secondary capture: RGB, YBR_FULL, YBR_FULL_422, 3 samples per pixel).

``DicomDataset`` keeps its one grey channel by default (its API is unchanged) but says so when it
converts colour; ``color_mode="rgb"`` keeps three channels and refuses a grey file, naming it;
``auto`` keeps colour when every file is colour. The pipeline's ``data.color_mode`` does the same,
and a colour input made grey is stated in the log, ``result.json`` and the report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from securetrain.masking.dicom.dataset import DicomDataset
from securetrain.masking.dicom.errors import ColorModeError
from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.runner import run_pipeline
from securetrain.pipeline.tasks.dicom import FramesDicomDataset

from .pipeline_fixtures import ROOT, colour_dicom, grey_dicom, small_config_data

POLICY = ROOT / "policies" / "dicom-basic.yaml"
KEY = bytes(range(32))


def _manifest(folder: Path, files: list[tuple[str, int]]) -> Path:
    lines = ["path,label", *(f"{name},{label}" for name, label in files)]
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    return folder / "labels.csv"


def _joint(truth: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] -> [3, H, W] scaled to [0, 1] with one min/max over all three channels."""
    a = truth.astype(np.float32)
    return torch.from_numpy(((a - a.min()) / (a.max() - a.min())).transpose(2, 0, 1).copy())


@pytest.mark.parametrize("photometric", ["RGB", "YBR_FULL", "YBR_FULL_422"])
def test_rgb_mode_keeps_three_channels(tmp_path: Path, photometric: str) -> None:
    truth = colour_dicom(tmp_path / "us.dcm", seed=1, photometric=photometric)[0]
    data = DicomDataset(_manifest(tmp_path, [("us.dcm", 1)]), POLICY, KEY, color_mode="rgb")
    assert data.color_mode == "rgb" and data.colour_files == 1 and data.grey_files == 0
    pixels = data[0]["pixels"]
    assert pixels.shape == (3, 16, 16)
    assert torch.allclose(pixels, _joint(truth), atol=1.5 / 255)  # R, G, B in order, not Y/Cb/Cr
    assert torch.equal(data[0]["pixels"], pixels)  # the cached-header path (later epochs) decodes alike


def test_default_stays_one_grey_channel_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    truth = colour_dicom(tmp_path / "us.dcm", seed=1)[0]
    with caplog.at_level(logging.WARNING):
        data = DicomDataset(_manifest(tmp_path, [("us.dcm", 1)]), POLICY, KEY)
    assert data.color_mode == "grey" and data.colour_files == 1  # the public API's default is unchanged
    pixels = data[0]["pixels"]
    grey = truth.astype(np.float32).mean(axis=-1)
    assert pixels.shape == (1, 16, 16)
    assert torch.allclose(pixels[0], torch.from_numpy((grey - grey.min()) / (grey.max() - grey.min())), atol=1e-5)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "1 colour file(s)" in warning and "one grey channel" in warning and "color_mode" in warning


def test_rgb_mode_refuses_a_grey_file_by_name(tmp_path: Path) -> None:
    colour_dicom(tmp_path / "a.dcm", seed=1)
    grey_dicom(tmp_path / "b.dcm", seed=2)
    manifest = _manifest(tmp_path, [("a.dcm", 0), ("b.dcm", 1)])
    with pytest.raises(ColorModeError, match=r"b\.dcm") as caught:
        DicomDataset(manifest, POLICY, KEY, color_mode="rgb")
    import pydicom

    patient = str(pydicom.dcmread(tmp_path / "b.dcm").PatientID)
    assert caught.value.path == "b.dcm" and patient not in str(caught.value)
    # auto: colour only when every file is colour; a mix is made grey (and said so).
    assert DicomDataset(manifest, POLICY, KEY, color_mode="auto").color_mode == "grey"
    only_colour = _manifest(tmp_path, [("a.dcm", 0)])
    assert DicomDataset(only_colour, POLICY, KEY, color_mode="auto").color_mode == "rgb"
    with pytest.raises(ValueError, match=r"color_mode"):
        DicomDataset(only_colour, POLICY, KEY, color_mode="colour")


def test_colour_frames_stack_per_frame_or_as_depth(tmp_path: Path) -> None:
    truth = colour_dicom(tmp_path / "cine.dcm", seed=3, frames=2)
    manifest = _manifest(tmp_path, [("cine.dcm", 1)])
    channels = FramesDicomDataset(manifest, POLICY, KEY, frames="all", color_mode="rgb")[0]["pixels"]
    assert channels.shape == (6, 16, 16)  # frame 0 R, G, B, then frame 1
    a = truth.astype(np.float32)
    joint = torch.from_numpy(((a - a.min()) / (a.max() - a.min())).transpose(0, 3, 1, 2).copy())
    assert torch.allclose(channels, joint.reshape(6, 16, 16), atol=1e-5)
    depth = FramesDicomDataset(manifest, POLICY, KEY, frames="all", frames_as="depth", color_mode="rgb")[0]["pixels"]
    assert depth.shape == (3, 2, 16, 16) and torch.allclose(depth, joint.permute(1, 0, 2, 3), atol=1e-5)
    middle = FramesDicomDataset(manifest, POLICY, KEY, frames="middle", color_mode="rgb")[0]["pixels"]
    assert middle.shape == (3, 16, 16)
    grey = FramesDicomDataset(manifest, POLICY, KEY, frames="all")[0]["pixels"]
    assert grey.shape == (2, 16, 16)


def _colour_run(tmp: Path, n: int = 8, *, grey_rows: tuple[int, ...] = (), **data: object) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        name = f"img{i}.dcm"
        if i in grey_rows:
            grey_dicom(tmp / name, seed=100 + i)
        else:
            colour_dicom(tmp / name, seed=100 + i, photometric=("RGB", "YBR_FULL")[i % 2])
        files.append((name, i % 2))
    return small_config_data(tmp, name="colour", data={"source": str(_manifest(tmp, files)), **data},
                             he={"enabled": False}, training={"epochs": 1})


def test_pipeline_rgb_trains_a_three_channel_model(tmp_path: Path) -> None:
    config = load_pipeline_config(data=_colour_run(tmp_path, color_mode="rgb"))
    result = run_pipeline(config)
    inputs = result.training.inputs
    assert inputs["color_mode"] == "rgb" and inputs["colour_files"] == 8 and inputs["converted_to_grey"] == 0
    from securetrain.pipeline import stages
    from securetrain.pipeline.secrets import load_run_secrets

    _, data = stages.task_datasets(config, load_run_secrets(config))
    assert data.model_facts["in_channels"] == 3 and data.train[0]["pixels"].shape[0] == 3
    assert "converted to one grey channel" not in result.report_html.read_text()


def test_pipeline_default_converts_colour_to_grey_and_says_so(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    config = load_pipeline_config(data=_colour_run(tmp_path))
    assert config.data.color_mode == "grey"
    with caplog.at_level(logging.WARNING):
        result = run_pipeline(config)
    inputs = json.loads((config.run_dir / "result.json").read_text())["training"]["inputs"]
    assert inputs == {"color_mode": "grey", "requested": "grey", "colour_files": 8, "grey_files": 0,
                      "converted_to_grey": 8}
    page = result.report_html.read_text()
    assert "8 colour input file(s) converted to one grey channel" in page and "data.color_mode: rgb" in page
    assert any("colour file(s)" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_pipeline_rgb_refuses_a_grey_file_naming_its_manifest_row(tmp_path: Path) -> None:
    config = load_pipeline_config(data=_colour_run(tmp_path, grey_rows=(3,), color_mode="rgb"))
    with pytest.raises(ColorModeError, match=r"manifest data row 4 \(de-identified as 000003\.dcm\)"):
        run_pipeline(config)
    assert not (config.run_dir / "checkpoints").exists()  # refused before training
    auto = load_pipeline_config(data=_colour_run(tmp_path / "auto", grey_rows=(3,), color_mode="auto"))
    inputs = run_pipeline(auto).training.inputs
    assert inputs["color_mode"] == "grey" and inputs["converted_to_grey"] == 7 and inputs["grey_files"] == 1

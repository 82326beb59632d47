"""Multi-frame DICOM in dicom-classification: a frame choice, or all frames as channels / depth."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from securetrain.pipeline.models import build_model
from securetrain.pipeline.tasks.dicom import FramesDicomDataset

from .pipeline_fixtures import ROOT

POLICY = ROOT / "policies" / "dicom-basic.yaml"
KEY = bytes(range(32))


@pytest.fixture(scope="module")
def multiframe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    from pydicom.uid import ExplicitVRLittleEndian

    from securetrain.masking.dicom.synthetic import generate_one

    tmp = tmp_path_factory.mktemp("frames")
    ds = generate_one(seed=5, modality="MR", label=1, image_size=12)
    rng = np.random.default_rng(0)
    frames = (rng.integers(0, 4000, size=(5, 12, 12)) * np.arange(1, 6)[:, None, None] // 5).astype(np.uint16)
    ds.NumberOfFrames = 5
    ds.PixelData = frames.tobytes()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    path = tmp / "multi.dcm"
    ds.save_as(path, enforce_file_format=True)
    (tmp / "labels.csv").write_text("path,label\nmulti.dcm,1\n")
    return tmp / "labels.csv", frames.astype(np.float32)


def _norm(a: np.ndarray) -> np.ndarray:
    return (a - a.min()) / (a.max() - a.min())


def _item(manifest: Path, **kw) -> torch.Tensor:  # noqa: ANN003
    return FramesDicomDataset(manifest, POLICY, KEY, **kw)[0]["pixels"]


def test_frame_choice(multiframe) -> None:
    manifest, frames = multiframe
    first = _item(manifest, frames="first")
    assert first.shape == (1, 12, 12) and torch.allclose(first[0], torch.from_numpy(_norm(frames[0])), atol=1e-6)
    third = _item(manifest, frames=3)
    assert torch.allclose(third[0], torch.from_numpy(_norm(frames[3])), atol=1e-6)
    middle = _item(manifest, frames="middle")
    assert torch.allclose(middle[0], torch.from_numpy(_norm(frames[2])), atol=1e-6)


def test_all_frames_as_channels_or_depth(multiframe) -> None:
    manifest, frames = multiframe
    channels = _item(manifest, frames="all")
    assert channels.shape == (5, 12, 12)
    assert torch.allclose(channels, torch.from_numpy(_norm(frames)), atol=1e-6)  # one scale for the volume
    depth = _item(manifest, frames="all", depth=3, frames_as="depth", size=8)
    assert depth.shape == (1, 3, 8, 8)
    resampled = _item(manifest, frames="all", depth=3)
    assert torch.allclose(resampled, torch.from_numpy(_norm(frames[[0, 2, 4]])), atol=1e-6)  # evenly spaced
    # The model factory gets in_channels from the item, so the built-in CNN takes all frames.
    model = build_model("cnn", {"channels": 2, "hidden": 4}, num_classes=3, in_channels=channels.shape[0])
    assert model(channels.unsqueeze(0)).shape == (1, 3)


def test_no_phi_in_the_items(multiframe) -> None:
    manifest, _ = multiframe
    item = FramesDicomDataset(manifest, POLICY, KEY, frames="all")[0]
    import pydicom

    raw = pydicom.dcmread(manifest.parent / "multi.dcm", stop_before_pixels=True)
    assert str(raw.PatientID) and str(raw.PatientID) not in str(item["meta"])
    assert os.fspath(manifest.parent) not in str(item["meta"])

"""Fixtures for tests/masking_dicom (helpers live in dicom_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dicom_fixtures import make_dataset, roundtrip
from pydicom.dataset import Dataset


@pytest.fixture
def phi_ds() -> Dataset:
    return roundtrip(make_dataset())


@pytest.fixture(scope="session")
def synthetic_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from securetrain.masking.dicom.synthetic import generate_study_set

    out = tmp_path_factory.mktemp("synthetic")
    return generate_study_set(out, n_patients=3, studies_per_patient=2, images_per_series=2, include_burned_in=True)

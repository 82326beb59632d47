"""Small pipeline configs for tests (a few seconds of training on CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def small_config_data(tmp_path: Path, name: str = "t", **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "output_dir": str(tmp_path / "runs"),
        "data": {
            "policy": str(ROOT / "policies" / "dicom-basic.yaml"),
            "image_size": 16,
            "synthetic": {"n_patients": 4, "studies_per_patient": 1, "images_per_series": 4, "image_size": 16},
        },
        "model": {"channels": 4, "hidden": 8},
        "training": {"epochs": 2, "batch_size": 4, "checkpoint_every": 2, "log_every": 1, "lr": 0.01},
        "secrets": {"create_demo_secrets": True},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def add_studies(manifest: Path, folder: Path, *, n_patients: int = 2, seed: int = 7) -> list[tuple[str, str]]:
    """New studies arrive (another site): generated under ``folder`` and appended to ``manifest``
    with absolute paths; returns the added (path, label) rows."""
    import csv

    from securetrain.masking.dicom.synthetic import generate_study_set

    extra = generate_study_set(folder, n_patients=n_patients, studies_per_patient=1, images_per_series=3,
                               image_size=16, seed=seed)
    with open(extra, newline="") as handle:
        added = [(str((extra.parent / row["path"]).resolve()), row["label"]) for row in csv.DictReader(handle)]
    with open(manifest, "a", newline="") as handle:
        csv.writer(handle, lineterminator="\n").writerows(added)
    return added


def planted_phi(run_dir: Path) -> set[str]:
    """Every PHI string the synthetic generator planted (dates/UIDs too), length >= 6."""
    phi = json.loads((run_dir / "raw" / "phi.json").read_text())
    values: set[str] = set()
    for kind in ("text", "dates", "uids"):
        values.update(v for v in phi["all"].get(kind, []) if len(v) >= 6)
    return values


# ------------------------------------------------------------------ bring-your-own-model helpers
USER_MODEL_PACKAGE = '''
import torch
from torch import nn

CONSTANT = 3


class TinyNet(nn.Module):
    """A user's model: its own layer names (encoder / classifier)."""

    def __init__(self, num_classes, in_channels=1, width=4):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()
        )
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.encoder(x))


def build(num_classes, width=4, in_channels=1):
    return TinyNet(num_classes, in_channels, width)


def no_bias_head(num_classes, in_channels=1, width=4):
    """A classifier without bias (the last nn.Linear is the head HE scores)."""
    return nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(4 * width, num_classes, bias=False))


def two_outputs(width=4):
    return TinyNet(2, 1, width)


def returns_dict(**kwargs):
    return {"not": "a module"}
'''

CLASS_NAMES = ["normal", "benign", "malignant"]


def write_user_model(folder: Path, package: str = "mynets") -> Path:
    """A model package outside the repository (next to the config that names it)."""
    pkg = folder / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(USER_MODEL_PACKAGE)
    return pkg


def three_class_dicom(folder: Path, *, n_patients: int = 6, label_column: str = "diagnosis") -> Path:
    """Synthetic PHI-laden studies labelled by patient into 3 string classes; returns the manifest."""
    import csv

    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(folder, n_patients=n_patients, studies_per_patient=1, images_per_series=3,
                                  image_size=16, seed=3)
    rows = list(csv.DictReader(manifest.open()))
    labelled = folder / "labels.csv"
    with labelled.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", label_column])
        for row in rows:
            patient = int(row["path"].split("/")[0][1:])
            writer.writerow([row["path"], CLASS_NAMES[patient % 3]])
    return labelled


def byom_config(tmp: Path, source: Path, name: str = "byom", **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "output_dir": str(tmp / "runs"),
        "task": "dicom-classification",
        "data": {"source": str(source), "label_column": "diagnosis", "image_size": 16, "eval_fraction": 0.34,
                 "policy": str(ROOT / "policies" / "dicom-basic.yaml")},
        "model": {"target": "mynets:build", "kwargs": {"width": 4}},
        "training": {"epochs": 3, "batch_size": 4, "log_every": 1, "lr": 0.01, "checkpoint_every": 4,
                     "scheduler": {"name": "cosine", "warmup_steps": 2}, "validation": {"metric": "accuracy"}},
        "secrets": {"create_demo_secrets": True},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def finance_config(tmp: Path, name: str = "fin", **sections: Any) -> dict[str, Any]:
    """examples/finance.yaml, made small and fast."""
    import yaml

    data = yaml.safe_load((ROOT / "examples" / "finance.yaml").read_text())
    data.update(name=name, output_dir=str(tmp / "runs"))
    data["data"]["policy"] = str(ROOT / "policies" / "finance-pii.yaml")
    data["data"]["synthetic_table"] = {"rows": 600, "customers": 120, "seed": 1}
    data["training"].update(epochs=3, batch_size=64, checkpoint_every=4, log_every=2)
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def scan_for(run_dir: Path, secrets: set[bytes], *, skip: tuple[str, ...] = ("raw", "keys")) -> int:
    """Assert no output file under run_dir contains any of ``secrets`` (case-insensitive); files scanned."""
    scanned = 0
    for path in run_dir.rglob("*"):
        rel = path.relative_to(run_dir)
        if not path.is_file() or rel.parts[0] in skip:
            continue
        data = path.read_bytes()
        upper = data.upper()
        leaks = [v for v in secrets if v in data or v.upper() in upper]
        assert not leaks, f"{rel} contains PHI/PII: {sorted(leaks)[:3]}"
        scanned += 1
    return scanned


def finance_pii(raw_table: Path) -> set[bytes]:
    """Every direct identifier of the raw transactions table (length >= 6)."""
    import pyarrow.parquet as pq

    table = pq.read_table(raw_table)
    values: set[bytes] = set()
    for column in ("customer_name", "customer_id", "iban", "card_number", "ssn", "email", "phone", "notes"):
        values.update(str(v).encode() for v in table.column(column).to_pylist() if v is not None and len(str(v)) >= 6)
    return values


# ------------------------------------------------------------------ colour DICOM (ultrasound, secondary capture)
def colour_dicom(path: Path, *, seed: int, photometric: str = "RGB", size: int = 16, frames: int = 1,
                 modality: str = "US") -> Any:
    """A synthetic colour image (a fresh fake patient, :func:`generate_one`) stored as ``photometric``
    (RGB, YBR_FULL or YBR_FULL_422; 8 bits, 3 samples per pixel, ``frames`` frames); returns the RGB
    truth, ``uint8[frames, size, size, 3]``. Chroma is constant per pixel pair, so 4:2:2 keeps it."""
    import numpy as np
    from pydicom.pixels import convert_color_space
    from pydicom.uid import ExplicitVRLittleEndian

    from securetrain.masking.dicom.synthetic import generate_one

    ds = generate_one(seed=seed, modality="MR", image_size=size)
    ds.Modality = modality
    ds.BurnedInAnnotation = "NO"  # a colour modality (US) is otherwise suspected of burned-in text
    rng = np.random.default_rng(seed)
    rgb = rng.integers(20, 235, (frames, size, size // 2, 3), dtype=np.uint8).repeat(2, axis=2)
    ybr = convert_color_space(rgb, "RGB", "YBR_FULL")
    truth = convert_color_space(ybr, "YBR_FULL", "RGB") if photometric != "RGB" else rgb
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, photometric, 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    for keyword in ("RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth"):
        if keyword in ds:
            delattr(ds, keyword)
    if frames > 1:
        ds.NumberOfFrames = frames
    if photometric == "RGB":
        ds.PixelData = rgb.tobytes()
    elif photometric == "YBR_FULL":
        ds.PixelData = ybr.tobytes()
    else:  # YBR_FULL_422: Y Y Cb Cr per pixel pair
        y, cb, cr = ybr[..., 0], ybr[..., 0::2, 1], ybr[..., 0::2, 2]
        ds.PixelData = np.stack([y[..., 0::2], y[..., 1::2], cb, cr], -1).tobytes()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.save_as(path, enforce_file_format=True)
    return truth


def grey_dicom(path: Path, *, seed: int, size: int = 16) -> None:
    """A synthetic one-channel image (:func:`generate_one`, MR) written to ``path``."""
    from pydicom.uid import ExplicitVRLittleEndian

    from securetrain.masking.dicom.synthetic import generate_one

    ds = generate_one(seed=seed, modality="MR", image_size=size)
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.save_as(path, enforce_file_format=True)

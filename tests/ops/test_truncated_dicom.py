"""A DICOM file cut anywhere is refused, never written as "de-identified" (issue 17).

pydicom stops silently at the end of the data: a file cut exactly between two elements, or inside
the next element's 8-byte header, reads "fine". The file meta (written first) still names the SOP
Class and Instance, so the data set must carry both.
"""

from __future__ import annotations

import importlib.util
import io
import warnings
from pathlib import Path

import pytest

from securetrain.masking.dicom.engine import (
    Deidentifier,
    check_complete,
    encode_dataset,
    read_dicom,
)
from securetrain.masking.dicom.errors import MissingPatientIdentityError, UnreadableDicomError
from securetrain.masking.dicom.policy import load_policy


def _load_fixtures():  # by path, without putting tests/masking_dicom (and its conftest) on sys.path
    path = Path(__file__).resolve().parents[1] / "masking_dicom" / "dicom_fixtures.py"
    spec = importlib.util.spec_from_file_location("_ops_dicom_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fx = _load_fixtures()
POLICY_DIR, SECRET, make_dataset = _fx.POLICY_DIR, _fx.SECRET, _fx.make_dataset


@pytest.mark.slow
def test_every_cut_point_of_a_synthetic_file_is_refused(tmp_path: Path) -> None:
    full = encode_dataset(make_dataset())
    deid = Deidentifier(load_policy(POLICY_DIR / "dicom-basic.yaml"), SECRET)
    src, dst = tmp_path / "cut.dcm", tmp_path / "out.dcm"
    src.write_bytes(full)
    deid.deidentify_file(src, dst)  # the whole file is fine
    dst.unlink()
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in range(len(full)):  # every cut point: inside values, headers, and on boundaries
            src.write_bytes(full[:n])
            try:
                deid.deidentify_file(src, dst)
            except (UnreadableDicomError, MissingPatientIdentityError):  # cut before PatientID/Name: no identity
                continue
            written.append(n)
            dst.unlink()
    # The one documented limit: a cut exactly between two elements after the SOP Instance UID and
    # before any image attribute looks like a complete header-only object (which Part 10 files such as
    # pydicom's DICOMDIR-referenced images are) and is written. Every other cut is refused: inside a
    # value, inside an element header, before the data set's SOP Class/Instance UID, after Rows.
    ds = read_dicom(io.BytesIO(full))
    ends = {int(t): ds._dict[t].value_tell + ds._dict[t].length for t in ds._dict}
    undecidable = {end for tag, end in ends.items() if 0x00080018 <= tag < 0x00280010}
    before_identity = [n for n in written if n < ends[0x00080018]]
    assert before_identity == [], f"cut before the data set's SOP identity written: {before_identity}"
    assert set(written) <= undecidable, f"written: {sorted(set(written) - undecidable)[:10]}"
    assert len(written) <= len(undecidable) < len(full) // 20


def test_meta_and_data_set_must_agree() -> None:
    ds = read_dicom(io.BytesIO(encode_dataset(make_dataset())))
    check_complete(ds, "ok")
    del ds.SOPClassUID
    with pytest.raises(UnreadableDicomError, match="SOPClassUID"):
        check_complete(ds, "cut")
    ds = read_dicom(io.BytesIO(encode_dataset(make_dataset())))
    ds.SOPInstanceUID = "1.2.3.4"
    with pytest.raises(UnreadableDicomError, match="differs"):
        check_complete(ds, "swapped")

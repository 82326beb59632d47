"""`securetrain deid`: outputs named by keyed UIDs, input names (which may carry PHI) only in the
encrypted mapping, and audit events recorded as the work happens (issue 17)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from securetrain.audit.log import AuditLog
from securetrain.masking.dicom.mapping import load_file_mapping
from securetrain.masking.dicom.synthetic import generate_study_set

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "policies" / "dicom-basic.yaml")
PHI = "SMITH^JOHN_MRN123"


def _env() -> dict[str, str]:
    # Nothing of the test session's settings, except the audit signing key its operator made with
    # `securetrain audit keygen` (tests/conftest.py): --audit-db never creates one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SECURETRAIN_") or k == "SECURETRAIN_AUDIT_KEY"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", COLUMNS="200")
    return env


def _phi_tree(tmp_path: Path, **kw: int) -> Path:
    raw = generate_study_set(tmp_path / "gen", include_burned_in=True, **kw).parent
    src = tmp_path / "in" / PHI
    shutil.copytree(raw, src)
    for i, f in enumerate(sorted(src.rglob("*.dcm"))):  # file names with PHI too
        f.rename(f.with_name(f"{PHI}_{i}.dcm"))
    return tmp_path / "in"


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    key, mkey = tmp_path / "deid.key", tmp_path / "map.key"
    key.write_text("ab" * 32)
    mkey.write_text("cd" * 32)
    key.chmod(0o600)
    mkey.chmod(0o600)
    return key, mkey


def _entries(db: Path) -> list:
    with AuditLog(db, create=False) as log:
        assert log.verify().ok
        return list(log.entries())


def test_outputs_named_by_uid_and_input_names_only_encrypted(tmp_path: Path) -> None:
    src = _phi_tree(tmp_path, n_patients=2, studies_per_patient=1, images_per_series=2)
    key, mkey = _keys(tmp_path)
    out, db, mapping = tmp_path / "out", tmp_path / "audit.db", tmp_path / "map.bin"
    proc = subprocess.run([sys.executable, "-m", "securetrain", "deid", str(src), str(out), "--policy", POLICY,
                           "--key-file", str(key), "--audit-db", str(db), "--mapping-out", str(mapping),
                           "--mapping-key-file", str(mkey), "-j", "2"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 65, proc.stderr[-2000:]  # manifest.csv and phi.json are quarantined (not DICOM)
    written = sorted(p for p in out.rglob("*") if p.is_file())
    assert written and all(p.parent == out and p.name.startswith("2.25.") for p in written)
    refusals = (tmp_path / "out.quarantine.json").read_text()  # by index and digest only
    for text in (proc.stdout + proc.stderr, refusals, *(str(e) for e in _entries(db))):
        assert "SMITH" not in text and "MRN123" not in text
    assert "rejected" in proc.stdout and "input #" in proc.stdout  # refusals by index + digest
    # ... and the encrypted mapping gives the names back
    files = load_file_mapping(mapping, bytes.fromhex("cd" * 32))
    assert sorted(files.values()) == [p.name for p in written]
    assert all(k.startswith(PHI) for k in files)
    assert b"SMITH" not in mapping.read_bytes()
    entries = _entries(db)
    assert {e.details["output"] for e in entries if e.action == "deid.write"} == {p.name for p in written}


@pytest.mark.slow
def test_interrupted_deid_leaves_audit_entries_for_its_outputs(tmp_path: Path) -> None:
    # Several chunks' worth of files: the interrupt comes once the first chunk is out, and with only
    # 96 files a fast run sometimes finished before it (exit 65 for the tree's non-DICOM file).
    src = _phi_tree(tmp_path, n_patients=16, studies_per_patient=2, images_per_series=8, image_size=64)
    key, _ = _keys(tmp_path)
    out, db = tmp_path / "out", tmp_path / "audit.db"
    proc = subprocess.Popen([sys.executable, "-m", "securetrain", "deid", str(src), str(out), "--policy", POLICY,
                             "--key-file", str(key), "--audit-db", str(db)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not (out.is_dir() and any(out.glob("2.25.*"))):
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    outputs = {p.name for p in out.iterdir()}
    assert not [n for n in outputs if n.endswith(".tmp")]  # the interrupted chunk's staged files are gone
    total = len(list(src.rglob("*.dcm")))
    assert 0 < len(outputs) < total
    audited = {e.details["output"] for e in _entries(db) if e.action == "deid.write"}
    assert audited and audited <= outputs  # every entry names an output that exists ...
    assert len(outputs - audited) <= 64  # ... and at most the chunk being recorded lacks one


def test_pydicom_never_prints_an_invalid_elements_value(tmp_path: Path) -> None:
    """pydicom quotes an invalid element's value in its warning (``Invalid value for VR UI: '...'``),
    on its logger and again as a Python warning on stderr: neither copy may carry the value."""
    import pydicom

    raw = generate_study_set(tmp_path / "gen", n_patients=1, studies_per_patient=1, images_per_series=1)
    src = tmp_path / "in"
    src.mkdir()
    f = next(raw.parent.rglob("*.dcm"))
    ds = pydicom.dcmread(f)
    # Written without validation, so reading it back makes pydicom complain about each value.
    with pydicom.config.disable_value_validation():
        ds.SOPInstanceUID = "JONES.MRN.1970.BORN19700101JS"  # not a UID: letters (seen in real files)
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.save_as(src / "one.dcm")
    key, _ = _keys(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "securetrain", "deid", str(src), str(tmp_path / "out"),
                           "--policy", POLICY, "--key-file", str(key)],
                          env=_env(), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), text[-2000:]
    assert "Traceback" not in text
    assert "Invalid value for VR UI" in text  # pydicom did complain (the case under test happened)
    assert "BORN19700101JS" not in text and "JONES.MRN" not in text, text[-3000:]

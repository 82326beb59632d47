"""The four user scripts in examples/scripts/ run as written, on public API only."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "examples" / "scripts"


def run(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_scripts_are_short_and_use_no_private_names(script: str) -> None:
    source = (SCRIPTS / script).read_text()
    tree = ast.parse(source)
    code_lines = [ln for ln in source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code_lines) <= 30, f"{script}: {len(code_lines)} lines"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("securetrain"):
            assert node.module.count(".") <= 2, f"{script} imports from an internal module {node.module}"
            assert not any(a.name.startswith("_") for a in node.names), script


def test_deidentify_folder(tmp_path: Path) -> None:
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "in", n_patients=2, studies_per_patient=1, images_per_series=2)
    manifest.unlink()
    (manifest.parent / "phi.json").unlink()  # only DICOM files in the folder
    proc = run("deidentify_folder.py", str(tmp_path / "in"), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "4 written, 0 refused" in proc.stdout
    assert len(list((tmp_path / "out").rglob("*.dcm"))) == 4


def test_deidentify_folder_exits_65_only_for_quarantined_files(tmp_path: Path) -> None:
    from securetrain.masking.dicom.synthetic import generate_study_set

    manifest = generate_study_set(tmp_path / "in", n_patients=1, studies_per_patient=1, images_per_series=2,
                                  include_burned_in=True)
    manifest.unlink()
    (manifest.parent / "phi.json").unlink()
    proc = run("deidentify_folder.py", str(tmp_path / "in"), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr  # burned-in files rejected by the policy: not a failure
    assert "2 written, 2 refused (2 rejected, 0 quarantined)" in proc.stdout
    (manifest.parent / "notes.txt").write_text("not DICOM")
    proc = run("deidentify_folder.py", str(tmp_path / "in"), str(tmp_path / "out2"))
    assert proc.returncode == 65, proc.stderr
    assert "2 written, 3 refused (2 rejected, 1 quarantined)" in proc.stdout


def test_encrypt_state_dict(tmp_path: Path) -> None:
    proc = run("encrypt_state_dict.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "restored the model" in proc.stdout and (tmp_path / "model.stenc").exists()


def test_audit_append_verify(tmp_path: Path) -> None:
    proc = run("audit_append_verify.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint at size 3; export verified: True" in proc.stdout


@pytest.mark.he
def test_he_evaluate() -> None:
    pytest.importorskip("tenseal")
    proc = run("he_evaluate.py")
    assert proc.returncode == 0, proc.stderr

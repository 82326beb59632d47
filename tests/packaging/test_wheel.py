"""The wheel works without the checkout: policies by name, the demo, the stand-alone verifier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("securetrain-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return target


def run_outside(installed: Path, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH puts the installed wheel ahead of the checkout's editable install; nothing from the
    # test session's Prefect settings leaks in, and stdin is closed (a prompt would fail, not hang).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SECURETRAIN_"))}
    env.update(PYTHONPATH=str(installed), PREFECT_HOME=str(cwd / ".prefect"), PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGABRT makes faulthandler print every thread's stack: the failure says where it hung.
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate()
        pytest.fail(f"{args} did not finish in {timeout} s\n{out[-3000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("securetrain/py.typed", "securetrain/_project/policies/dicom-basic.yaml",
                   "securetrain/_project/policies/finance-pii.yaml", "securetrain/_project/flows/secure_training.py",
                   "securetrain/_project/examples/demo.yaml", "securetrain_audit_verify/verify_audit.py",
                   "securetrain_audit_verify/__main__.py", "securetrain_audit_verify/verify_provenance.py",
                   "securetrain/_project/policies/release.yaml"):
        assert needed in names, needed
    assert not any(n.startswith(("tests/", "audit/", "policies/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "securetrain-audit-verify = securetrain_audit_verify.verify_audit:main" in text
    assert "securetrain-provenance-verify = securetrain_audit_verify.verify_provenance:main" in text


def test_installed_wheel_loads_policies_by_name(installed: Path, tmp_path: Path) -> None:
    code = ("import securetrain, json\n"
            "from securetrain.masking.dicom.policy import load_policy as dicom\n"
            "from securetrain.masking.tabular.policy import load_policy as table\n"
            "print(json.dumps([securetrain.__file__, securetrain.__version__, dicom('dicom-basic').name, table('finance-pii').name]))")
    proc = run_outside(installed, tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    path, version, dicom_name, table_name = json.loads(proc.stdout)
    assert path.startswith(str(installed))
    assert version != "0+unknown" and dicom_name and table_name


def test_unknown_policy_name_lists_the_shipped_ones(installed: Path, tmp_path: Path) -> None:
    code = "from securetrain.masking.dicom.policy import load_policy\nload_policy('dicom-basci')"
    proc = run_outside(installed, tmp_path, "-c", code)
    assert proc.returncode != 0
    assert "no policy named 'dicom-basci'" in proc.stderr and "dicom-basic" in proc.stderr


@pytest.mark.slow
def test_installed_wheel_runs_the_demo_and_verifies_its_export(installed: Path, tmp_path: Path) -> None:
    proc = run_outside(installed, tmp_path, "-m", "securetrain", "demo", "--no-prefect", timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export = next(tmp_path.glob("runs/*/audit-export"))
    args = ["-m", "securetrain_audit_verify", str(export)]
    public_key = export / "public_key.pem"
    help_text = run_outside(installed, tmp_path, "-m", "securetrain_audit_verify", "--help").stdout
    if "--public-key" in help_text:
        args += ["--public-key", str(public_key)]
    verified = run_outside(installed, tmp_path, *args)
    assert verified.returncode == 0, verified.stdout + verified.stderr

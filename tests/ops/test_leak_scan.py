"""Leak scan (issue 17, "done when"): a run through Prefect whose inputs carry PHI in their folder
and file names and whose audit URL carries a password leaves neither in the run folder, the Prefect
home (database, result storage, logs) or the console. (The stored deployment is scanned by
test_prefect_deployment.py.)"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "Leak-Pa55w0rd-7f3a"
PHI_DIR = "SMITH^JOHN_MRN123456"
FORBIDDEN = [PASSWORD.encode(), b"SMITH^JOHN", b"MRN123456"]


def _database() -> str | None:
    try:
        import psycopg

        name = f"leak_{uuid.uuid4().hex[:10]}"
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True, connect_timeout=5) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return name
    except Exception:  # noqa: BLE001
        return None


def _drop(name: str) -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _phi_inputs(tmp_path: Path) -> Path:
    from securetrain.masking.dicom.synthetic import generate_study_set

    src = tmp_path / "inputs" / PHI_DIR
    manifest = generate_study_set(src, n_patients=6, studies_per_patient=1, images_per_series=4, image_size=16,
                                  include_burned_in=True)
    rows = list(csv.DictReader(manifest.open()))
    for i, row in enumerate(rows):  # file names with PHI as well
        old = manifest.parent / row["path"]
        new = old.with_name(f"{PHI_DIR}_{i}.dcm")
        old.rename(new)
        row["path"] = str(new.relative_to(src.parent))
    manifest.unlink()
    manifest = src.parent / "manifest.csv"  # the operator's config names this file, not the PHI folders
    with manifest.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def _scan(root: Path, skip: tuple[str, ...] = ()) -> int:
    scanned = 0
    for path in root.rglob("*"):
        if not path.is_file() or any(part in skip for part in path.relative_to(root).parts):
            continue
        data = path.read_bytes()
        for needle in FORBIDDEN:
            assert needle not in data, f"{path.relative_to(root)} contains {needle!r}"
        assert PHI_DIR not in str(path), path
        scanned += 1
    return scanned


@pytest.mark.slow
def test_no_credential_or_phi_in_run_folder_prefect_home_or_console(tmp_path: Path) -> None:
    db = _database()
    if db is None:
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is not available")
    try:
        manifest = _phi_inputs(tmp_path)
        cfg = tmp_path / "leak.yaml"
        cfg.write_text(f"""
name: leak
output_dir: {tmp_path / 'runs'}
data:
  source: {manifest}
  policy: {ROOT / 'policies' / 'dicom-basic.yaml'}
  image_size: 16
model: {{channels: 4, hidden: 8}}
training: {{epochs: 1, batch_size: 8, checkpoint_every: 5, keep_last: 1, device: cpu}}
he: {{enabled: false}}
secrets: {{create_demo_secrets: true}}
""")
        home = tmp_path / "prefect-home"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURETRAIN_", "PREFECT_API"))}
        env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(home), OMP_NUM_THREADS="1", COLUMNS="200",
                   SECURETRAIN_AUDIT_URL=f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:5432/{db}")
        proc = subprocess.run([sys.executable, "-m", "securetrain", "run", str(cfg)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        console = (proc.stdout + proc.stderr).encode()
        assert proc.returncode == 0, proc.stderr[-3000:]
        for needle in FORBIDDEN:
            assert needle not in console, f"console shows {needle!r}"
        assert b"***" in console  # the audit URL is shown, masked
        assert _scan(tmp_path / "runs" / "leak", skip=("keys",)) > 10
        assert _scan(home) > 0
    finally:
        _drop(db)

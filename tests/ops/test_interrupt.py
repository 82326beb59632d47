"""Ctrl-C during ``securetrain run`` (through Prefect and without): keep the work, stop cleanly, exit 130.

The terminal sends SIGINT to the whole foreground process group; the test does the same with
``killpg``. Through Prefect, the temporary server must outlive the pipeline (it runs in a session of
its own) and must be gone once the command has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"""
name: intr
output_dir: {tmp_path / 'runs'}
data:
  policy: {ROOT / 'policies' / 'dicom-basic.yaml'}
  image_size: 16
  synthetic: {{n_patients: 6, studies_per_patient: 2, images_per_series: 4, seed: 0}}
model: {{channels: 4, hidden: 8}}
training: {{epochs: 400, batch_size: 8, checkpoint_every: 5, keep_last: 2, device: cpu, log_every: 1}}
he: {{enabled: false}}
secrets: {{create_demo_secrets: true}}
""")
    return cfg


def _processes_with(marker: str) -> list[str]:
    alive = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker.encode() in (d / "environ").read_bytes():
                alive.append(d.name)
        except OSError:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefect", "no-prefect"])
def test_ctrl_c_during_training_keeps_the_checkpoint_and_exits_130(tmp_path: Path, mode: str) -> None:
    home = str(tmp_path / "prefect-home")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=home, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    extra = ["--no-prefect"] if mode == "no-prefect" else []
    proc = subprocess.Popen(
        [sys.executable, "-c", "from securetrain.cli.main import main; main()", "run", str(_config(tmp_path)), *extra],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    ckpt_dir = tmp_path / "runs" / "intr" / "checkpoints"
    # Wait for ANY step checkpoint: with keep_last: 2 a given step may be pruned before a poll sees it.
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while not seen and proc.poll() is None and time.monotonic() < deadline:
        seen = sorted(p.name for p in ckpt_dir.glob("step-*.stenc")) if ckpt_dir.is_dir() else []
        if not seen:
            time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert seen, "no checkpoint appeared within 300 s"
    first_seen = seen[-1]
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    stopped = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - stopped < 60  # the step finishes; the run does not carry on
    assert "Traceback" not in out + err
    assert "interrupted at step" in err and "run the same command again" in err
    steps = sorted(p.name for p in ckpt_dir.glob("step-*.stenc"))
    assert steps and steps[-1] >= first_seen  # the interrupted step's checkpoint is kept
    assert not _processes_with(home)  # no temporary server (or anything else) left behind

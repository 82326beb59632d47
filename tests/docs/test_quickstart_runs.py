"""The quick start's commands run as written (issue 17: it named checkpoints the demo no longer keeps).

A small pipeline run stands in for `make demo` (same layout: `runs/demo/...`, demo secrets), then
every bash block of docs/quickstart.md from "Individual stages" on runs in order in one shell with
`set -e`, `securetrain` and `python` being this interpreter. Any command the docs show that fails
(a wrong file name, a removed option) fails this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _blocks_from(text: str, heading: str) -> list[str]:
    tail = text[text.index(heading):]
    return re.findall(r"^```bash\n(.*?)^```", tail, flags=re.S | re.M)


@pytest.mark.slow
def test_quickstart_stages_run_as_written(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("policies", "examples", "audit"):
        (repo / name).symlink_to(ROOT / name)
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(f"""
name: demo
output_dir: {repo / 'runs'}
data:
  policy: {ROOT / 'policies' / 'dicom-basic.yaml'}
  image_size: 16
  synthetic: {{n_patients: 6, studies_per_patient: 2, images_per_series: 4, seed: 0, include_burned_in: true}}
model: {{channels: 4, hidden: 8}}
training: {{epochs: 2, batch_size: 8, checkpoint_every: 3, keep_last: 2, device: cpu}}
he: {{enabled: false}}
secrets: {{create_demo_secrets: true}}
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURETRAIN_", "PREFECT_API"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PREFECT_HOME=str(tmp_path / "ph"), COLUMNS="160")
    run = subprocess.run([sys.executable, "-m", "securetrain", "run", str(cfg), "--no-prefect"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert list((repo / "runs" / "demo" / "checkpoints").glob("step-*.stenc"))

    text = (ROOT / "docs" / "quickstart.md").read_text()
    blocks = _blocks_from(text, "## Individual stages")
    assert len(blocks) >= 8
    script = "\n".join([
        "set -euo pipefail",
        f'securetrain() {{ "{sys.executable}" -m securetrain "$@"; }}',
        f'python() {{ "{sys.executable}" "$@"; }}',
        *blocks,
    ])
    proc = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr

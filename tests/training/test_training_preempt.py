"""SIGTERM mid-training -> clean checkpoint + exit 75 -> resume -> bit-identical final weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from securetrain.training import PREEMPTED_EXIT_CODE, SafetensorsCheckpointStore
from securetrain.training import state as st

WORKER = Path(__file__).with_name("preempt_worker.py")
# 96 samples / batch 8 = 12 micro-batches = 6 optimizer steps per epoch, 3 epochs = 18 steps.
PAUSE_AT = 8  # mid-epoch 2: position 4 of 12


def _run(out: Path, final: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(out), str(final), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


@pytest.mark.slow
def test_sigterm_checkpoint_and_bit_identical_resume(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref", tmp_path / "ref.safetensors")
    victim = _run(tmp_path / "run", tmp_path / "run.safetensors", "--pause-at", str(PAUSE_AT))
    assert victim.stdout is not None
    for line in victim.stdout:
        if line.strip() == f"step {PAUSE_AT}":
            victim.send_signal(signal.SIGTERM)
            break
    else:
        pytest.fail(f"worker never reported step {PAUSE_AT}: {victim.communicate()[1]}")
    rest, err = victim.communicate(timeout=60)
    assert victim.returncode == PREEMPTED_EXIT_CODE, err
    assert f"done preempted {PAUSE_AT}" in rest

    store = SafetensorsCheckpointStore(tmp_path / "run" / "checkpoints")
    latest = store.latest()
    assert latest is not None and latest.step == PAUSE_AT  # the in-flight step finished, nothing more
    saved = st.loads(store.load(latest).metadata["securetrain.train.state"])
    assert (saved["epoch"], saved["position"]) == (1, 4)  # genuinely mid-epoch

    resumed = _run(tmp_path / "run", tmp_path / "run.safetensors")
    out, err = resumed.communicate(timeout=60)
    assert resumed.returncode == 0, err
    assert out.splitlines()[0] == f"step {PAUSE_AT + 1}"  # resumed, did not restart
    assert "done completed 18" in out

    ref_out, ref_err = ref.communicate(timeout=60)
    assert ref.returncode == 0, ref_err
    a, b = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "run.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

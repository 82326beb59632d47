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


def _stop_at(proc: subprocess.Popen[str], marker: str, sig: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == marker:
            proc.send_signal(sig)
            return
    pytest.fail(f"worker never printed {marker!r}: {proc.communicate()[1]}")


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_checkpoints_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C means what SIGTERM means (finish the step, checkpoint), with the shell's exit 130."""
    from securetrain.training import INTERRUPTED_EXIT_CODE

    victim = _run(tmp_path / "run", tmp_path / "run.safetensors", "--pause-at", str(PAUSE_AT))
    _stop_at(victim, f"step {PAUSE_AT}", signal.SIGINT)
    rest, err = victim.communicate(timeout=60)
    assert victim.returncode == INTERRUPTED_EXIT_CODE == 130, err
    assert "Traceback" not in err and f"done preempted {PAUSE_AT}" in rest
    latest = SafetensorsCheckpointStore(tmp_path / "run" / "checkpoints").latest()
    assert latest is not None and latest.step == PAUSE_AT  # the work is kept

    resumed = _run(tmp_path / "run", tmp_path / "run.safetensors")
    out, err = resumed.communicate(timeout=60)
    assert resumed.returncode == 0, err
    assert out.splitlines()[0] == f"step {PAUSE_AT + 1}" and "done completed 18" in out


@pytest.mark.slow
def test_second_ctrl_c_aborts_at_once(tmp_path: Path) -> None:
    """A second Ctrl-C during a long step aborts without waiting for it (and writes no checkpoint)."""
    import time

    victim = _run(tmp_path / "run", tmp_path / "run.safetensors", "--pause-at", str(PAUSE_AT), "--hang-after-stop")
    _stop_at(victim, f"step {PAUSE_AT}", signal.SIGINT)
    _stop_at(victim, "stop requested", signal.SIGINT)
    started = time.monotonic()
    victim.communicate(timeout=60)
    assert time.monotonic() - started < 20  # the 30 s step was cut short
    assert victim.returncode not in (0, PREEMPTED_EXIT_CODE, 130)
    latest = SafetensorsCheckpointStore(tmp_path / "run" / "checkpoints").latest()
    assert latest is None or latest.step < PAUSE_AT

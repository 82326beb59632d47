"""Multi-process training from the pipeline: the train stage launches ``torchrun``.

With ``training.nproc_per_node > 1`` (or ``training.nnodes > 1``) the train stage does not train
in its own process: it writes a launch request (the validated config and the status file's
path: no secrets) under ``<run_dir>/train/launch/`` and runs::

    python -m torch.distributed.run --nproc-per-node N --nnodes M (--standalone | --rdzv-*) \\
        -m securetrain.pipeline.train_worker <request.json>

as a child of the stage (a Prefect task, or the ``--no-prefect`` library call). Every rank resolves
the run's secrets itself from the environment / the keys folder it inherits (never from argv);
global rank 0 records the audit events and writes ``status-<nonce>.json`` with the training
summary (or the preemption / the error). The stage streams the children's output line by line to
its logger, then maps the outcome:

* a status saying ``preempted`` (or, without one, a torchrun exit status of 75 / 130, or a signal
  this stage forwarded) -> :class:`~securetrain.pipeline.stages.PipelinePreempted` (Prefect does
  not retry it; rerunning resumes from the checkpoint);
* a summary -> the :class:`TrainingSummary` with ``world_size``;
* anything else -> :class:`TrainingLaunchError` (retriable: the trainer resumes).

Signals: torchrun runs in its own session, so a terminal's Ctrl-C reaches only this stage, which
forwards exactly one SIGINT (or SIGTERM) to torchrun; torchrun forwards it to the ranks, which
finish the step, checkpoint and stop. A second Ctrl-C interrupts every process of the job at once.
If this process dies, the kernel sends torchrun SIGTERM (``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from securetrain.cpus import usable_cpus
from securetrain.errors import SecureTrainError
from securetrain.io.atomic import atomic_write_bytes

log = logging.getLogger("securetrain.pipeline.train")

WORKER_MODULE = "securetrain.pipeline.train_worker"
LAUNCH_DIR = Path("train") / "launch"
PREEMPT_CODES = (75, 130)


class TrainingLaunchError(SecureTrainError):
    """The torchrun job failed (a rank crashed, rendezvous timed out, torchrun is missing)."""


def running_under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def needs_launch(config: Any) -> bool:
    """True when the stage must start torchrun (more than one process, not already inside one)."""
    return config.training.launch_world_size > 1 and not running_under_torchrun()


def torchrun_command(config: Any, request: Path) -> list[str]:
    """The launch command line: only counts, rendezvous settings and a file path (never a secret)."""
    t = config.training
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={t.nproc_per_node}",
           f"--nnodes={t.nnodes}", "--max-restarts=0"]
    if t.nnodes == 1 and not t.rdzv.endpoint:
        cmd.append("--standalone")  # a free local port, a fresh run id
    else:
        cmd += [f"--rdzv-backend={t.rdzv.backend}", f"--rdzv-endpoint={t.rdzv.endpoint}",
                f"--rdzv-id={t.rdzv.id or config.name}"]
        if t.node_rank is not None:
            cmd.append(f"--node-rank={t.node_rank}")
        if t.rdzv.timeout_s:
            cmd.append(f"--rdzv-conf=join_timeout={t.rdzv.timeout_s}")
    return [*cmd, "-m", WORKER_MODULE, str(request)]


def _child_setup() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001 - best effort: without it an orphaned job still finishes
            pass


def _worker_env(config: Any) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" not in env:  # torchrun would force 1 (with a warning); share the cores instead
        cores = usable_cpus()
        env["OMP_NUM_THREADS"] = str(max(1, cores // config.training.nproc_per_node))
    return env


def launch_training(config: Any, prepared: Any, *, log_line: Callable[[str], None] | None = None) -> Any:
    """Run the train stage on ``training.nproc_per_node x nnodes`` processes; the rank-0 summary."""
    from securetrain.pipeline.results import TrainingSummary
    from securetrain.pipeline.stages import PipelinePreempted

    emit = log_line or log.info
    folder = config.run_dir / LAUNCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    nonce = secrets.token_hex(8)
    request = folder / f"request-{nonce}.json"
    status_path = folder / f"status-{nonce}.json"
    atomic_write_bytes(request, json.dumps({
        "config": config.model_dump(mode="json"),
        "status": str(status_path),
    }).encode(), mode=0o600)
    cmd = torchrun_command(config, request)
    t = config.training
    emit(f"launching torchrun: {t.nproc_per_node} process(es) x {t.nnodes} node(s), strategy {t.strategy}")
    try:
        proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_worker_env(config), text=True,
            errors="replace", bufsize=1, start_new_session=True, preexec_fn=_child_setup,  # noqa: PLW1509
        )
    except OSError as exc:
        raise TrainingLaunchError(f"cannot start torchrun: {exc}", hint="is torch installed in this environment?") from exc
    forwarded: list[int] = []

    def forward(signum: int, frame: Any) -> None:  # noqa: ARG001
        if forwarded and signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # second Ctrl-C: every rank aborts now
        elif proc.poll() is None:
            os.kill(proc.pid, signum)
        forwarded.append(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, forward)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            emit(line.rstrip("\n"))
        rc = proc.wait()
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        request.unlink(missing_ok=True)
    status = _read_status(status_path)
    if status.get("outcome") == "preempted" or (not status and (rc in PREEMPT_CODES or forwarded)):
        code = int(status.get("exit_code") or (rc if rc in PREEMPT_CODES else 0)
                   or (130 if forwarded and forwarded[0] == signal.SIGINT else 75))
        what = "interrupted" if code == 130 else "preempted"
        at = f" at step {status['steps']}" if status.get("steps") is not None else ""
        raise PipelinePreempted(f"training {what}{at} (torchrun job of {t.launch_world_size} processes)",
                                hint="run the same command again to resume", exit_code=code)
    if status.get("outcome") == "error":
        raise TrainingLaunchError(f"rank 0 failed: {status.get('error', 'unknown error')}",
                                  hint=status.get("hint") or "see the training log lines above")
    if rc != 0 or status.get("outcome") != "completed":
        raise TrainingLaunchError(f"the torchrun job exited with status {rc}" + ("" if status else " without a result"),
                                  hint="see the training log lines above (a rank failed or rendezvous timed out)")
    return TrainingSummary.model_validate(status["summary"])


def _read_status(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    finally:
        path.unlink(missing_ok=True)
    return data if isinstance(data, dict) else {}

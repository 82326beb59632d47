"""Start a test worker script on two CPU processes (``torchrun --nproc_per_node=2 --standalone``,
gloo), one thread each: how the DDP/FSDP tests run their workers. Imported by the test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def run_two_ranks(worker: Path, out: Path, *, timeout: float = 180, env: Mapping[str, str] | None = None,
                  unset: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``worker OUT`` on two ranks; assert it exited 0 (showing the end of its stderr)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for name in unset:
        full_env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(worker), str(out)],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc

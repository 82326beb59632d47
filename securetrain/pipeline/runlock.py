"""One run at a time per run folder: an exclusive ``flock`` on ``<run_dir>/.run.lock``.

Two runs in one folder (a schedule firing while the previous run still trains, or an operator
starting a run by hand) would interleave checkpoints, audit entries and reports. The lock is taken
before any work and held until the run returns; the kernel releases it when the process dies, so
a crashed run never leaves a stale lock. The file holds the holder's pid (for the
error message), never anything secret.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from securetrain.pipeline.errors import PipelineError

LOCK_NAME = ".run.lock"


class RunFolderBusyError(PipelineError):
    """Another run holds this run folder."""


@contextlib.contextmanager
def run_folder_lock(run_dir: Path) -> Iterator[Path]:
    """Hold the run folder's lock for the ``with`` block; :class:`RunFolderBusyError` if taken."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("ascii", "replace").strip() or "another process"
            raise RunFolderBusyError(
                f"run folder {run_dir} is in use by another run ({holder})",
                hint="wait for it to finish, or give this run another name/output_dir",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock

"""Provenance and per-stage timing of a run: version, source commit, Prefect flow run id, clock.

Nothing here can fail a run: a missing git, an unreadable checkout or no Prefect context just
leave the field empty.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from securetrain.pipeline.results import RunInfo

ENV_SOURCE_COMMIT = "SECURETRAIN_SOURCE_COMMIT"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def source_commit(*, mark_dirty: bool = True) -> str | None:
    """``$SECURETRAIN_SOURCE_COMMIT`` (set it in images built without .git), else the checkout's HEAD.

    ``mark_dirty``: append ``-dirty`` when tracked files differ from HEAD (the run report says so);
    signed provenance asks for the bare 40-hex commit instead."""
    if os.environ.get(ENV_SOURCE_COMMIT):
        return os.environ[ENV_SOURCE_COMMIT].strip()[:64] or None
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        head = out.stdout.strip()
        if out.returncode != 0 or len(head) != 40:
            return None
        if not mark_dirty:
            return head
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def flow_run_id() -> str | None:
    """The Prefect flow run this code runs in, if any (never imports Prefect itself)."""
    if "prefect" not in sys.modules:
        return None
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:  # noqa: BLE001 -- provenance is best effort
        return None


class StageClock:
    """Start/end time and wall seconds per stage, in the order the stages ran."""

    def __init__(self) -> None:
        self.started_at = _now()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t, 3)

    def info(self) -> RunInfo:
        from securetrain import __version__

        return RunInfo(securetrain_version=__version__, source_commit=source_commit(), flow_run_id=flow_run_id(),
                       started_at=self.started_at, finished_at=_now(), stage_seconds=dict(self.seconds))

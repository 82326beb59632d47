"""One run at a time per run folder (issue 17: two scheduled runs overlapped in one folder)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from securetrain.pipeline.runlock import RunFolderBusyError, run_folder_lock


def _hold(run_dir: str, ready, release) -> None:  # noqa: ANN001
    with run_folder_lock(Path(run_dir)):
        ready.set()
        release.wait(30)


def test_a_second_run_in_the_same_folder_is_refused_until_the_first_ends(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / "run"), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(RunFolderBusyError, match=f"pid {holder.pid}"):
            with run_folder_lock(tmp_path / "run"):
                pass
    finally:
        release.set()
        holder.join(30)
    with run_folder_lock(tmp_path / "run") as lock:  # free again once the holder is gone
        assert (os.stat(lock).st_mode & 0o077) == 0


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / "run"), ready, release))
    holder.start()
    assert ready.wait(30)
    holder.kill()
    holder.join(30)
    with run_folder_lock(tmp_path / "run"):
        pass


def test_run_pipeline_refuses_a_busy_folder(tmp_path: Path) -> None:
    from securetrain.pipeline.config import PipelineConfig
    from securetrain.pipeline.runner import run_pipeline

    config = PipelineConfig.model_validate({"name": "busy", "output_dir": str(tmp_path),
                                            "secrets": {"create_demo_secrets": True}})
    with run_folder_lock(config.run_dir), pytest.raises(RunFolderBusyError):
        run_pipeline(config)
    assert not (config.run_dir / "audit.db").exists()  # refused before any work

"""Prefect task runners from ``execution:`` (threads, processes, Dask, Ray): existing engines, never a home-made one."""

from __future__ import annotations

import importlib
from typing import Any

from securetrain.errors import ConfigError
from securetrain.pipeline.config import ExecutionConfig


def build_task_runner(execution: ExecutionConfig) -> Any:
    """A Prefect ``TaskRunner`` for ``execution.task_runner`` (not entered yet), or None for ``serial``."""
    kind, n = execution.task_runner, execution.n_workers
    if kind == "serial":
        return None
    if kind == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=n)
    if kind == "process":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=n)
    if kind == "dask":
        DaskTaskRunner = _extra_runner("dask", "DaskTaskRunner")
        if execution.address:
            return DaskTaskRunner(address=execution.address)
        # Processes, one thread each: de-identification is CPU-bound Python (the GIL), and a
        # dashboard port would collide between concurrent runs.
        return DaskTaskRunner(cluster_kwargs={"n_workers": n, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None})
    if kind == "ray":
        RayTaskRunner = _extra_runner("ray", "RayTaskRunner")
        if execution.address:
            return RayTaskRunner(address=execution.address)
        return RayTaskRunner(init_kwargs={"num_cpus": n, "include_dashboard": False})
    raise ConfigError(f"unknown execution.task_runner {kind!r}")


def _extra_runner(kind: str, name: str) -> Any:
    """``prefect_<kind>.<name>`` from the optional extra ``securetrain[<kind>]``, or a ConfigError."""
    try:
        return getattr(importlib.import_module(f"prefect_{kind}"), name)
    except ImportError:
        raise ConfigError(f"execution.task_runner {kind!r} needs prefect-{kind}",
                          hint=f"pip install 'securetrain[{kind}]'") from None

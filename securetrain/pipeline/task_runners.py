"""Prefect task runners from ``execution:`` (threads, processes, Dask, Ray): existing engines, never a home-made one."""

from __future__ import annotations

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
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise ConfigError("execution.task_runner 'dask' needs prefect-dask",
                              hint="pip install 'securetrain[dask]'") from None
        if execution.address:
            return DaskTaskRunner(address=execution.address)
        # Processes, one thread each: de-identification is CPU-bound Python (the GIL), and a
        # dashboard port would collide between concurrent runs.
        return DaskTaskRunner(cluster_kwargs={"n_workers": n, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None})
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise ConfigError("execution.task_runner 'ray' needs prefect-ray",
                              hint="pip install 'securetrain[ray]'") from None
        if execution.address:
            return RayTaskRunner(address=execution.address)
        return RayTaskRunner(init_kwargs={"num_cpus": n, "include_dashboard": False})
    raise ConfigError(f"unknown execution.task_runner {kind!r}")

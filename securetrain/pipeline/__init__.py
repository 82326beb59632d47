"""The end-to-end pipeline as a plain library: ``run_pipeline(config)``.

Each stage is a function in :mod:`securetrain.pipeline.stages`; ``flows/secure_training.py`` wraps
the same functions as Prefect tasks, so the pipeline runs identically with and without Prefect.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PipelineConfig", "PipelineResult", "run_pipeline", "load_pipeline_config"]


def __getattr__(name: str) -> Any:  # lazy: keep `securetrain --help` free of torch imports
    if name in {"PipelineConfig", "load_pipeline_config"}:
        from securetrain.pipeline import config

        return getattr(config, name)
    if name == "PipelineResult":
        from securetrain.pipeline.results import PipelineResult

        return PipelineResult
    if name == "run_pipeline":
        from securetrain.pipeline.runner import run_pipeline

        return run_pipeline
    raise AttributeError(name)

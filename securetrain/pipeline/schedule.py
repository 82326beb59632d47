"""Scheduled runs: every run of a schedule gets its own run folder and reports what input is new.

A nightly deployment that reused one run folder resumed the finished run every night and trained
0 steps. A scheduled run is instead named ``<config name>-<UTC time>[-<flow run id prefix>]`` (its
*series* is the config name), ingests the data present when it starts, and its report lists the
input files (by SHA-256, never by name: names may carry PHI) that the previous run of the series
did not read.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.config import PipelineConfig

#: Digests of every input file a run read, written by the de-identification stage.
INPUTS_FILE = "inputs.json"
_STAMP = "%Y%m%dT%H%M%SZ"


def scheduled_run_config(config: PipelineConfig, *, now: datetime | None = None,
                         flow_run_id: str | None = None) -> PipelineConfig:
    """``config`` for one scheduled run: its own run folder, in the series named by ``config.name``."""
    series = config.series or config.name
    suffix = (now or datetime.now(UTC)).astimezone(UTC).strftime(_STAMP)
    if flow_run_id:
        suffix += "-" + re.sub(r"[^A-Za-z0-9]", "", flow_run_id)[:8]
    elif (config.output_dir / _run_name(series, suffix)).exists():
        # Two runs started in the same second without a flow run id (by hand): never share a folder.
        suffix += "-" + secrets.token_hex(4)
    return config.model_copy(update={"name": _run_name(series, suffix), "series": series})


def _run_name(series: str, suffix: str) -> str:
    """``<series>-<suffix>``, the series cut so the name fits the config's 64-character pattern."""
    return f"{series[: 63 - len(suffix)]}-{suffix}"


def write_inputs(run_dir: Path, digests: set[str]) -> None:
    atomic_write_bytes(run_dir / INPUTS_FILE, json.dumps({"sha256": sorted(digests)}).encode(), mode=0o600)


def _read_inputs(run_dir: Path) -> set[str] | None:
    try:
        data = json.loads((run_dir / INPUTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    values = data.get("sha256") if isinstance(data, dict) else None
    return {v for v in values if isinstance(v, str)} if isinstance(values, list) else None


_SUFFIX = re.compile(r"-(\d{8}T\d{6}Z(?:-[A-Za-z0-9]{1,8})?)$")


def _series_suffix(name: str, series: str) -> str | None:
    """The ``<UTC time>[-<id>]`` suffix when ``name`` is a run of exactly ``series`` (not of a longer
    series that shares its prefix, such as ``nightly-eu`` for ``nightly``), else None."""
    match = _SUFFIX.search(name)
    if match is None:
        return None
    suffix = match.group(1)
    return suffix if name == _run_name(series, suffix) else None


def previous_run(config: PipelineConfig) -> Path | None:
    """The latest earlier run folder of this run's series that recorded its inputs."""
    if not config.series or not config.output_dir.is_dir():
        return None
    own = _series_suffix(config.name, config.series) or ""
    earlier = []
    for p in config.output_dir.iterdir():
        suffix = _series_suffix(p.name, config.series)
        # Ordered by the time stamp, not the name: a long series is cut to fit the stamp and id.
        if suffix is not None and p.name != config.name and suffix < own and (p / INPUTS_FILE).is_file():
            earlier.append((suffix, p))
    return max(earlier)[1] if earlier else None


def input_changes(config: PipelineConfig, *, listed: int = 50) -> dict[str, Any] | None:
    """For a scheduled run: counts (and the first ``listed`` digests) of inputs new since the previous run."""
    if not config.series:
        return None
    current = _read_inputs(config.run_dir)
    if current is None:
        return None
    before = previous_run(config)
    old = _read_inputs(before) if before is not None else None
    new = sorted(current - (old or set()))
    return {
        "series": config.series,
        "previous_run": before.name if before is not None else None,
        "inputs": len(current),
        "new": len(new),
        "removed": len((old or set()) - current),
        "new_sha256": new[:listed],
    }

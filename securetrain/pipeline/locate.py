"""Find the project's non-package files (flows/, audit/, policies/, examples/).

They live at the top of the source tree (and under /app in the Docker images), not inside the
Python package: the auditor's verifier must not depend on securetrain, and operators edit the
policies and flows. Search order: the working directory, then the tree this package came from.
"""

from __future__ import annotations

from pathlib import Path

from securetrain.errors import ConfigError


def project_roots() -> list[Path]:
    return [Path.cwd(), Path(__file__).resolve().parents[2]]


def find_project_file(relative: str, *, required: bool = True) -> Path | None:
    for root in project_roots():
        candidate = root / relative
        if candidate.exists():
            return candidate
    if required:
        raise ConfigError(
            f"cannot find {relative} in {', '.join(str(r) for r in project_roots())}",
            hint="run from the securetrain source tree (or /app in the Docker image)",
        )
    return None

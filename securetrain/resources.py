"""Find the project's non-package files (flows/, audit/, policies/, examples/) and policies by name.

They live at the top of the source tree (and under /app in the Docker images), not inside the
Python package, because operators edit and review them there. A wheel carries copies under
``securetrain/_project/`` (see setup.py). Search order: the working directory (an operator's own
edited copy wins), the source tree this package came from, then the copies inside the installed
package.
"""

from __future__ import annotations

import os
from pathlib import Path

from securetrain.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent


def project_roots() -> list[Path]:
    roots = [Path.cwd(), PACKAGE_DIR.parent, PACKAGE_DIR / "_project"]
    return list(dict.fromkeys(roots))


def find_project_file(relative: str, *, required: bool = True) -> Path | None:
    for root in project_roots():
        candidate = root / relative
        if candidate.exists():
            return candidate
    if required:
        raise ConfigError(
            f"cannot find {relative} in {', '.join(str(r) for r in project_roots())}",
            hint="run from the securetrain source tree (or /app in the Docker image), or reinstall the wheel",
        )
    return None


def resolve_policy(name_or_path: str | os.PathLike[str]) -> Path:
    """A policy given by path, or by name (``"dicom-basic"`` → ``policies/dicom-basic.yaml``)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    text = str(name_or_path)
    if "/" not in text and "\\" not in text:
        stem = text[:-5] if text.endswith(".yaml") else text
        found = find_project_file(f"policies/{stem}.yaml", required=False)
        if found is not None:
            return found
        shipped = sorted(p.stem for root in project_roots() for p in (root / "policies").glob("*.yaml"))
        raise ConfigError(f"no policy named {text!r}", hint=f"shipped policies: {', '.join(dict.fromkeys(shipped)) or 'none'}; or give a path")
    raise ConfigError(f"policy file {text} not found", hint="give an existing path or a shipped policy name")

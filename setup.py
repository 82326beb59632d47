"""Build hooks that pyproject.toml cannot express.

The project's operator-facing files (policies/, flows/, examples/*.yaml) live at the top of the source
tree, where operators edit and review them. A wheel has no source tree, so ``build_py`` copies them
into ``securetrain/_project/`` inside the wheel; ``securetrain.resources`` finds them there (or in the
checkout). The auditor's verifier ``audit/verify_audit.py`` ships as the stand-alone top-level package
``securetrain_audit_verify`` (mapped from ``audit/``), so it still imports nothing from securetrain.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# (source, glob) pairs copied into securetrain/_project/<source> of the wheel.
PROJECT_FILES = [("policies", "*.yaml"), ("flows", "*.py"), ("examples", "*.yaml"), ("examples", "*.py")]


class BuildPyWithProjectFiles(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # editable installs read the checkout itself
            return
        target = Path(self.build_lib) / "securetrain" / "_project"
        for folder, pattern in PROJECT_FILES:
            for source in sorted((ROOT / folder).glob(pattern)):
                dest = target / folder / source.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest)


setup(
    packages=find_packages(include=["securetrain", "securetrain.*"]) + ["securetrain_audit_verify"],
    package_dir={"securetrain_audit_verify": "audit"},
    cmdclass={"build_py": BuildPyWithProjectFiles},
)

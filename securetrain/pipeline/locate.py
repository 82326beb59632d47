"""Where the pipeline finds flows, examples and policies: see :mod:`securetrain.resources`."""

from securetrain.resources import PACKAGE_DIR, find_project_file, project_roots, resolve_policy

__all__ = ["PACKAGE_DIR", "find_project_file", "project_roots", "resolve_policy"]

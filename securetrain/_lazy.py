"""Lazy package exports: ``securetrain --help`` must not pay for importing torch, pydicom or pyarrow.

A package lists ``{public name: submodule}`` and gets a module-level ``__getattr__`` (PEP 562)
that imports the submodule on first access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """``__getattr__`` for ``package``; a submodule is relative (``"trainer"``) or absolute."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = module if module.startswith("securetrain.") else f"{package}.{module}"
        return getattr(importlib.import_module(target), name)

    return __getattr__

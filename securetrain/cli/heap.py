"""Keep Python's cyclic garbage collector off the long-lived objects of a command's process.

A pipeline run imports torch, pydantic, SQLAlchemy, matplotlib (and Prefect): several hundred
thousand objects that live until the process ends. Every full collection walks all of them again
(a run makes several, about 0.2 s each on a busy 2-core machine), and so does the final collection
at interpreter exit. :func:`freeze_long_lived` moves what is alive now to the collector's permanent
generation (``gc.freeze``): those objects are still freed by reference counting as usual, only the
cycle search skips them. Objects created later are collected as before. ``gc.freeze`` only splices
the collector's lists (it costs nothing), so calling it after each import-heavy step is fine.

Only the console entry point (:func:`securetrain.cli.main.main`) turns this on: it owns its process
from start to end. A library caller or a test runner that calls the commands in-process keeps its
collector as it is.
"""

from __future__ import annotations

import gc

_owns_process = False


def own_process() -> None:
    """Called by the console entry point: this process runs one command and then exits."""
    global _owns_process
    _owns_process = True


def freeze_long_lived() -> bool:
    """Exclude every object alive now from future cyclic collections; False when not the CLI process."""
    if not _owns_process:
        return False
    gc.freeze()
    return True

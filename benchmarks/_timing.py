"""Timing helper shared by the benchmark scripts (run as ``python benchmarks/X.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` wall-clock runs of ``fn`` in seconds: the least noise-inflated one."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best

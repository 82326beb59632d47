"""How many CPUs this process may use (one answer for every sizing decision in the package)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (Linux; a container's
    or ``taskset``'s limit), else the machine's count; at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

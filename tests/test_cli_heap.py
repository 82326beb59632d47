"""securetrain.cli.heap: the console entry point keeps the cyclic collector off long-lived objects;
in-process callers (libraries, test runners) are left alone."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from securetrain.cli import heap


@pytest.fixture
def fresh_heap(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(heap, "_owns_process", False)
    yield
    gc.unfreeze()


def test_in_process_callers_keep_their_collector(fresh_heap) -> None:
    before = gc.get_freeze_count()
    assert heap.freeze_long_lived() is False
    assert gc.get_freeze_count() == before


def test_the_command_process_freezes_what_is_alive(fresh_heap) -> None:
    heap.own_process()
    assert heap.freeze_long_lived() is True
    assert gc.get_freeze_count() > 0
    garbage = []
    garbage.append(garbage)  # a cycle made after the freeze is still collected
    del garbage
    assert gc.collect() >= 1


_PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen", gc.get_freeze_count(), file=sys.stderr))
from securetrain.cli.main import main
main()
"""


@pytest.mark.parametrize("args, code", [(["--version"], 0), (["audit", "verify", "--db", "/nonexistent/x.db"], 2)])
def test_the_console_entry_point_exits_with_a_frozen_heap(args: list[str], code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    frozen = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("frozen ")]
    assert frozen and frozen[0] > 0, proc.stderr

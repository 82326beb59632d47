"""securetrain.pipeline.prefect_tuning: a sync flow run no longer waits for its heartbeat thread, and
the heartbeats themselves still run (crash detection stays on)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prefect")

from prefect import flow_engine  # noqa: E402

from securetrain.pipeline import prefect_tuning  # noqa: E402


class _Engine:
    """What ``_send_heartbeats`` reads from a flow run engine, with the emissions recorded."""

    heartbeat_seconds = 30
    logger = SimpleNamespace(debug=lambda *a, **k: None)

    def __init__(self) -> None:
        self.flow_run = SimpleNamespace(state=SimpleNamespace(is_final=lambda: False))
        self.beats: list[float] = []
        self.first_beat = threading.Event()

    def _build_heartbeat_event_template(self):  # noqa: ANN202
        return {"prefect.resource.id": "prefect.flow-run.test"}, []

    def _emit_flow_run_heartbeat(self, resource, related) -> None:  # noqa: ANN001
        self.beats.append(time.monotonic())
        self.first_beat.set()


def _heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "heartbeat_loop" in repr(getattr(t, "_args", ()))]


@pytest.fixture
def stock_prefect(monkeypatch: pytest.MonkeyPatch):
    """Prefect's own ``_send_heartbeats`` for the test, whatever was installed before; restored after."""
    original = flow_engine._send_heartbeats
    stock = original.__wrapped__ if getattr(original, prefect_tuning._MARK, False) else original
    monkeypatch.setattr(flow_engine, "_send_heartbeats", stock)
    return stock


def test_a_flow_run_ends_without_waiting_for_the_heartbeat_thread(stock_prefect) -> None:
    assert prefect_tuning.skip_heartbeat_join() is True
    engine = _Engine()
    with flow_engine._send_heartbeats(engine):
        assert engine.first_beat.wait(10), "the heartbeat thread did not beat at the start of the run"
        started = time.monotonic()
    took = time.monotonic() - started
    # Stock Prefect joins the thread, which is asleep for the rest of its 1 s step: about 1 s here.
    assert took < 0.5, f"leaving the flow run took {took:.2f} s"
    assert len(engine.beats) == 1
    deadline = time.monotonic() + 5
    while _heartbeat_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _heartbeat_threads(), "the heartbeat thread did not stop on its own"
    assert len(engine.beats) == 1, "a heartbeat was sent after the run ended"


def test_it_is_installed_once_and_marked(stock_prefect) -> None:
    assert prefect_tuning.skip_heartbeat_join() is True
    wrapped = flow_engine._send_heartbeats
    assert prefect_tuning.skip_heartbeat_join() is True
    assert flow_engine._send_heartbeats is wrapped and wrapped.__wrapped__ is stock_prefect


def test_the_secure_training_flow_module_installs_it(stock_prefect) -> None:
    import importlib
    import sys

    from .pipeline_fixtures import ROOT

    sys.path.insert(0, str(ROOT))
    import flows.secure_training as module

    importlib.reload(module)
    assert getattr(flow_engine._send_heartbeats, prefect_tuning._MARK, False)


def test_an_unknown_prefect_is_left_alone(stock_prefect, monkeypatch: pytest.MonkeyPatch) -> None:
    def reshaped(engine, join_on_exit=True, extra=None):  # noqa: ANN001, ANN202
        return None

    assert prefect_tuning._supported("3.9.1", stock_prefect)
    assert not prefect_tuning._supported("4.0.0", stock_prefect)
    assert not prefect_tuning._supported("2.20.0", stock_prefect)
    assert not prefect_tuning._supported("3.9.1", reshaped)
    assert not prefect_tuning._supported("3.9.1", lambda engine: None)
    monkeypatch.setattr(flow_engine, "_send_heartbeats", reshaped)
    assert prefect_tuning.skip_heartbeat_join() is False
    assert flow_engine._send_heartbeats is reshaped
    monkeypatch.delattr(flow_engine, "_send_heartbeats")
    assert prefect_tuning.skip_heartbeat_join() is False

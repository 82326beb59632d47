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


# --- plain_json_parameters: the flow's parameters are stored as Prefect stores them, without FastAPI ---

_PARAMETER_CASES = [
    {"config_path": "/srv/run.yaml", "overrides": None, "new_run": False},
    {"config_path": None, "overrides": {"training": {"epochs": 3, "lr": 0.01, "tags": ["a", "b"]}}, "new_run": True},
    {"config_path": "x", "overrides": {}, "new_run": False},
]


def _two_flows():  # noqa: ANN202
    from prefect import flow

    def pipeline(config_path=None, overrides=None, new_run=False):  # noqa: ANN001, ANN202
        return config_path

    stock = flow(pipeline, name="stock")
    tuned = flow(pipeline, name="tuned")
    assert prefect_tuning.plain_json_parameters(tuned)
    assert prefect_tuning.plain_json_parameters(tuned)  # idempotent: wraps once
    return stock, tuned


@pytest.mark.parametrize("parameters", _PARAMETER_CASES)
def test_plain_parameters_are_stored_exactly_as_prefect_stores_them(parameters) -> None:  # noqa: ANN001
    stock, tuned = _two_flows()
    got = tuned.serialize_parameters(parameters)
    assert got == stock.serialize_parameters(parameters)
    if parameters["overrides"]:
        got["overrides"]["training"]["tags"].append("c")  # a copy: the caller's dict is not shared
        assert parameters["overrides"]["training"]["tags"] == ["a", "b"]


def test_other_values_still_go_to_prefects_encoder() -> None:
    import enum
    from pathlib import Path

    class Mode(str, enum.Enum):
        FAST = "fast"

    class Settings(dict):
        pass

    stock, tuned = _two_flows()
    for parameters in ({"config_path": Path("/srv/run.yaml")}, {"overrides": {"mode": Mode.FAST}},
                       {"overrides": ("a", 1)}, {"overrides": Settings(a=1)}, {"overrides": {1: "int key"}}):
        assert tuned.serialize_parameters(parameters) == stock.serialize_parameters(parameters)
    assert tuned.serialize_parameters({"config_path": Path("/srv/run.yaml")}) == {"config_path": "/srv/run.yaml"}
    assert tuned.serialize_parameters({"overrides": {"mode": Mode.FAST}}) == {"overrides": {"mode": "fast"}}


def test_the_pipeline_flow_serializes_its_parameters_without_importing_fastapi() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from flows.secure_training import secure_training\n"
        "out = secure_training.serialize_parameters({'config_path': '/c.yaml', 'overrides': {'a': [1]}, 'new_run': True})\n"
        "assert out == {'config_path': '/c.yaml', 'overrides': {'a': [1]}, 'new_run': True}, out\n"
        "print('fastapi' in sys.modules)\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"

"""Remove pure waiting from a Prefect flow run, without turning any Prefect feature off.

Prefect 3's synchronous flow engine keeps a daemon thread sending the flow run's heartbeats (crash
detection) and, when the flow ends, joins it. The thread sleeps in 1-second steps, so every sync
flow run ends with 0 to 1 s of waiting for nothing (about 1 s for a short flow). Prefect's async
engine does not join the same thread (``join_on_exit=False``): the thread sees its stop event at
the end of the current second and exits on its own, and it never emits for a run in a final state.
:func:`skip_heartbeat_join` makes the sync engine do the same. Heartbeats still start with the flow
run and keep their interval; only the wait at the end goes.

The change is one wrapper around ``prefect.flow_engine._send_heartbeats`` (a private function), so
it is guarded: Prefect 3, and a ``join_on_exit`` parameter defaulting to True. Anything else
(another major version, a renamed or reshaped function) leaves Prefect untouched: the run is then
correct, just up to 1 s slower.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

log = logging.getLogger(__name__)

_MARK = "__securetrain_skip_join__"


def skip_heartbeat_join() -> bool:
    """Let sync flow runs end without waiting for the heartbeat thread; True when in effect."""
    try:
        import prefect
        from prefect import flow_engine
    except ImportError:
        return False
    original = getattr(flow_engine, "_send_heartbeats", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    if not _supported(str(getattr(prefect, "__version__", "")), original):
        log.debug("Prefect %s: heartbeat join left as is", getattr(prefect, "__version__", "?"))
        return False

    @functools.wraps(original)
    def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Any:  # noqa: ARG001 - always False
        return original(engine, join_on_exit=False)

    setattr(send_heartbeats, _MARK, True)
    flow_engine._send_heartbeats = send_heartbeats  # type: ignore[attr-defined]
    return True


def _supported(version: str, function: Any) -> bool:
    """Prefect 3.x with ``_send_heartbeats(engine, join_on_exit=True)`` (as in 3.9)."""
    if version.split(".", 1)[0] != "3":
        return False
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and params[1].name == "join_on_exit" and params[1].default is True

"""Remove pure waiting and needless imports from a Prefect flow run, without turning any Prefect
feature off.

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

:func:`plain_json_parameters` serializes a flow's parameters without importing FastAPI when they
are already plain JSON values (a config path, a dict of overrides, a flag). Prefect stores the
flow run's parameters through ``Flow.serialize_parameters``, which imports ``fastapi.encoders``
(FastAPI, Starlette and their OpenAPI models: 0.12-0.3 s per process) to call ``jsonable_encoder``,
whose result for such values is the values themselves. Anything else (a model, a path object, an
enum, a future) still goes to Prefect's method, so what is stored never changes.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any

log = logging.getLogger(__name__)

_MARK = "__securetrain_skip_join__"
_PLAIN_MARK = "__securetrain_plain_json__"


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


_JSON_SCALARS = (str, int, float, bool, type(None))


def _is_plain_json(value: Any) -> bool:
    """True for values ``jsonable_encoder`` returns unchanged: exact JSON scalars, lists and
    str-keyed dicts of them (exact types: a str-valued Enum or a dict subclass is encoded by Prefect)."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return True
    if kind is list:
        return all(_is_plain_json(item) for item in value)
    if kind is dict:
        return all(type(key) is str and _is_plain_json(item) for key, item in value.items())
    return False


def _copy_json(value: Any) -> Any:
    if type(value) is list:
        return [_copy_json(item) for item in value]
    if type(value) is dict:
        return {key: _copy_json(item) for key, item in value.items()}
    return value


def plain_json_parameters(flow: Any) -> bool:
    """Serialize ``flow``'s plain JSON parameters without FastAPI; True when in effect.

    Only this flow object changes (``with_options`` copies are stock Prefect). Parameters that are
    not all plain JSON go to Prefect's own ``serialize_parameters`` unchanged."""
    stock = getattr(flow, "serialize_parameters", None)
    if stock is None or getattr(stock, _PLAIN_MARK, False):
        return stock is not None
    if getattr(flow, "ismethod", False) or getattr(flow, "isclassmethod", False):
        return False  # Prefect drops the bound self/cls there: leave that to its own method

    def serialize_parameters(self: Any, parameters: dict[str, Any]) -> dict[str, Any]:
        if type(parameters) is dict and _is_plain_json(parameters):
            return _copy_json(parameters)
        return stock(parameters)

    setattr(serialize_parameters, _PLAIN_MARK, True)
    flow.serialize_parameters = types.MethodType(serialize_parameters, flow)
    return True

"""The temporary Prefect server of ``securetrain run``/``demo``, in a session of its own.

Without ``PREFECT_API_URL`` Prefect starts a temporary server as a child process on first use. That
child shares the terminal's process group, so Ctrl-C reaches it as well as the pipeline: the server
dies at once while the flow carries on, and fails minutes later with a connection traceback. Started
here first, in its own session, the server only stops when the pipeline has stopped (Prefect's exit
hook terminates it), so the run can record its final state and exit with the same status as
``--no-prefect`` (130 after Ctrl-C, 75 after SIGTERM).
"""

from __future__ import annotations

import functools
import subprocess
import types


def uses_temporary_server() -> bool:
    """True when no Prefect API is configured, i.e. Prefect would start a temporary server."""
    from prefect.settings import get_current_settings

    return not get_current_settings().api.url


def start_temporary_server() -> None:
    """Start Prefect's temporary server now, detached from the terminal's process group.

    Prefect keeps one server instance per process (``SubprocessASGIServer()``), so its clients then
    reuse this one. Only this module's ``Popen`` call is changed (``start_new_session=True``).
    """
    import prefect.server.api.server as server_module

    server = server_module.SubprocessASGIServer()
    if server.running:
        return
    detached = types.SimpleNamespace(**{name: getattr(subprocess, name) for name in dir(subprocess)
                                        if not name.startswith("__")})
    detached.Popen = functools.partial(subprocess.Popen, start_new_session=True)
    original = server_module.subprocess
    server_module.subprocess = detached  # type: ignore[assignment]
    try:
        server.start()
    finally:
        server_module.subprocess = original

"""A torchrun rank of the train stage ends without interpreter teardown (securetrain.pipeline.train_worker).

An FSDP2 model keeps the gloo process group, and so gloo's threads, alive after
``destroy_process_group()``; tearing the interpreter and C++ statics down around running threads
can abort the rank at exit ("terminate called without an active exception"). The rank does what a
normal exit does for Python code, then leaves with ``os._exit``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from .pipeline_fixtures import ROOT

SCRIPT = textwrap.dedent('''
    import atexit, sys, threading, time
    from securetrain.pipeline.train_worker import exit_process

    class Global:
        def __del__(self):
            print("module teardown ran", flush=True)

    keep = Global()  # a module global: collected by interpreter teardown, never by os._exit

    def work():
        time.sleep(0.3)
        print("non-daemon thread finished", flush=True)

    threading.Thread(target=work).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.stdout.write("buffered output kept")
    exit_process(3)
''')


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_exit_process_keeps_python_exit_semantics_but_skips_interpreter_teardown() -> None:
    proc = _python("-c", SCRIPT)
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    assert "non-daemon thread finished" in out and "atexit ran" in out and "buffered output kept" in out
    assert out.index("non-daemon thread finished") < out.index("atexit ran")  # the order of a normal exit
    assert "module teardown ran" not in out
    control = _python("-c", SCRIPT.replace("exit_process(3)", "sys.exit(3)"))
    assert control.returncode == 3 and "module teardown ran" in control.stdout  # what os._exit skips


def test_worker_usage_and_errors_keep_their_status_and_message(tmp_path) -> None:  # noqa: ANN001
    usage = _python("-m", "securetrain.pipeline.train_worker")
    assert usage.returncode == 1 and "usage: python -m securetrain.pipeline.train_worker" in usage.stderr
    missing = _python("-m", "securetrain.pipeline.train_worker", str(tmp_path / "no-request.json"))
    assert missing.returncode == 1 and "Traceback" in missing.stderr and "FileNotFoundError" in missing.stderr

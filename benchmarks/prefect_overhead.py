"""Prefect overhead: the same small pipeline with ``--no-prefect`` and through the ``secure_training``
flow, against an already running Prefect server (and, without ``--quick``, the temporary server).

Every run is a fresh ``securetrain run CONFIG`` process on a fresh run folder (same config, same
seed), interleaved (plain, flow, plain, flow, ...) so drifting load hits both sides equally. We
report medians, the ratio and the difference. Goal (issue 17): the flow's own overhead against a
running server stays under +2 s; the temporary server adds its start-up (and is not a target).

Prefect's own floor is measured in the same run: a process that imports what the pipeline imports anyway
(torch, pydantic, httpx, SQLAlchemy, rich) and then runs an *empty* flow with the same three parameters and
as many no-op tasks as the pipeline has, against the same server, minus the same process without Prefect.
It is the cost of using Prefect at all (import, serializing the parameters, flow-run creation, draining
logs and events at exit, and a bigger heap to tear down), which no flow can go below; the rest of the
difference is securetrain's. It is measured twice: with stock Prefect, and with the three changes
securetrain makes (the sync engine no longer waits up to 1 s for the heartbeat thread, plain JSON
parameters are stored without importing FastAPI, and the heap is frozen before exit:
securetrain.pipeline.prefect_tuning, securetrain.cli.heap), applied to both sides.

    python benchmarks/prefect_overhead.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 2.0
CPU: dict[str, list[float]] = {}  # CPU seconds (user + system) of each finished run, by kind


def _children_cpu() -> float:
    """CPU seconds of the finished, reaped child processes so far (the running server is not one)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _config(folder: Path, name: str, epochs: int) -> Path:
    cfg = folder / f"{name}.yaml"
    cfg.write_text(f"""
name: {name}
output_dir: {folder / 'runs'}
data:
  policy: {ROOT / 'policies' / 'dicom-basic.yaml'}
  image_size: 16
  synthetic: {{n_patients: 6, studies_per_patient: 2, images_per_series: 4, seed: 0}}
model: {{channels: 4, hidden: 8}}
training: {{epochs: {epochs}, batch_size: 8, checkpoint_every: 50, keep_last: 1, device: cpu}}
he: {{enabled: false}}
secrets: {{create_demo_secrets: true}}
""")
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(home: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    proc = subprocess.Popen([prefect, "server", "start", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the Prefect server did not start within 180 s")


def _run(cfg: Path, *, prefect: str | None, home: Path) -> float:
    """Wall seconds of one ``securetrain run`` (``prefect``: None = --no-prefect, "" = temporary server)."""
    shutil.rmtree(cfg.parent / "runs", ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SECURETRAIN_") and k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(home), OMP_NUM_THREADS="1", DO_NOT_TRACK="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    args = [sys.executable, "-m", "securetrain", "run", str(cfg)]
    if prefect is None:
        args.append("--no-prefect")
    elif prefect:
        env["PREFECT_API_URL"] = prefect
    t, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - t
    kind = "plain" if prefect is None else ("flow" if prefect else "temporary")
    CPU.setdefault(kind, []).append(_children_cpu() - cpu)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return took


_FLOOR_SCRIPT = """
import sys
import torch, pydantic, httpx, sqlalchemy, rich  # noqa: F401 - imported by the pipeline either way
kind, tasks, tuned = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "tuned"
if kind == "prefect":
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    if tuned:
        from securetrain.pipeline.prefect_tuning import plain_json_parameters, skip_heartbeat_join

        assert skip_heartbeat_join()

    @task(cache_policy=NO_CACHE, result_serializer="json")
    def step(i: int) -> int:
        return i

    @flow(result_serializer="json")
    def empty(config_path: str | None = None, overrides: dict | None = None, new_run: bool = False) -> list:
        return [step(i) for i in range(tasks)]

    if tuned:
        assert plain_json_parameters(empty)
    empty(config_path="/bench/config.yaml", overrides=None, new_run=False)  # the flow's parameters
if tuned:
    import gc

    gc.freeze()  # as securetrain's CLI does before exit
"""
PIPELINE_TASKS = 5  # ingest, prepare-data, train, sign-provenance, seal-audit (HE off)


def _floor_run(kind: str, *, tuned: bool, url: str, home: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SECURETRAIN_")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_API_URL=url, PREFECT_HOME=str(home), OMP_NUM_THREADS="1",
               DO_NOT_TRACK="1")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", _FLOOR_SCRIPT, kind, str(PIPELINE_TASKS), "tuned" if tuned else "stock"],
                   env=env, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch, 2 pairs, no temporary-server run")
    ap.add_argument("--repeat", type=int, default=None, help="pairs of runs (default 5, quick 2)")
    args = ap.parse_args()
    repeat = args.repeat or (2 if args.quick else 5)
    epochs = 1 if args.quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cfg = _config(folder, "bench", epochs)
        server, url = _start_server(folder / "server-home")
        try:
            plain: list[float] = []
            flow: list[float] = []
            floors: dict[tuple[str, bool], list[float]] = {}
            home = folder / "client-home"
            for _ in range(repeat):
                plain.append(_run(cfg, prefect=None, home=home))
                flow.append(_run(cfg, prefect=url, home=home))
                for tuned in (False, True):
                    for kind in ("bare", "prefect"):
                        floors.setdefault((kind, tuned), []).append(_floor_run(kind, tuned=tuned, url=url, home=home))
        finally:
            server.terminate()
            server.wait(timeout=60)
        p, f = statistics.median(plain), statistics.median(flow)
        stock, tuned_floor = (statistics.median(floors["prefect", t]) - statistics.median(floors["bare", t])
                              for t in (False, True))
        print(f"pipeline, {epochs} epoch(s), {repeat} interleaved pairs (medians of whole `securetrain run` processes)")
        print(f"  --no-prefect                 {p:7.2f} s")
        print(f"  flow, running server         {f:7.2f} s   ratio {f / p:.2f}x   overhead {f - p:+.2f} s "
              f"(target < +{TARGET_S:.0f} s: {'met' if f - p < TARGET_S else 'NOT met'})")
        print(f"  Prefect's floor, stock       {stock:+7.2f} s   (an empty flow, same 3 parameters, {PIPELINE_TASKS} no-op "
              "tasks, same server: import, flow-run set-up, heartbeat join, drain at exit)")
        print(f"  Prefect's floor, tuned       {tuned_floor:+7.2f} s   (the same with securetrain's changes: no heartbeat "
              "join, heap frozen before exit)")
        print(f"  securetrain beyond the floor {f - p - tuned_floor:+7.2f} s   (flow overhead minus the tuned floor)")
        cp, cf = statistics.median(CPU["plain"]), statistics.median(CPU["flow"])
        print(f"  CPU time (user+sys, medians) --no-prefect {cp:.2f} s, flow {cf:.2f} s: {cf - cp:+.2f} s "
              "(load-independent; the wall-clock overhead adds waiting on the server)")
        print(f"  load average at the end      {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPU(s)")
        if not args.quick:
            temp = _run(cfg, prefect="", home=folder / "temp-home")
            print(f"  flow, temporary server       {temp:7.2f} s   ratio {temp / p:.2f}x   overhead {temp - p:+.2f} s "
                  "(includes the server's start-up and shutdown)")


if __name__ == "__main__":
    main()

"""prefect.yaml / serve.py: nothing resolved from the deployer's environment, one run at a time."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_prefect_yaml_has_no_deploy_time_placeholders() -> None:
    text = (ROOT / "prefect.yaml").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "{{ $" not in body and "{{$" not in body  # `prefect deploy` would bake the deployer's value
    spec = yaml.safe_load(text)
    for deployment in spec["deployments"]:
        assert "job_variables" not in (deployment.get("work_pool") or {})
        assert deployment["concurrency_limit"] == 1
    assert any("deploy_steps.set_working_directory_from_env" in next(iter(step)) for step in spec["pull"])


def test_serve_sets_concurrency() -> None:
    text = (ROOT / "flows" / "serve.py").read_text()
    assert "limit=1" in text and "global_limit=1" in text


def test_working_directory_step_reads_the_worker_environment(tmp_path, monkeypatch) -> None:
    from securetrain.errors import ConfigError
    from securetrain.pipeline.deploy_steps import set_working_directory_from_env

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SECURETRAIN_HOME", str(tmp_path))
    assert set_working_directory_from_env()["directory"] == str(tmp_path.resolve())
    assert Path.cwd() == tmp_path.resolve()
    monkeypatch.delenv("SECURETRAIN_HOME")
    with pytest.raises(ConfigError, match="SECURETRAIN_HOME"):
        set_working_directory_from_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_stored_deployment_holds_no_deployer_value(tmp_path) -> None:
    """`prefect deploy --all` with a password and a home folder in the deployer's env stores neither."""
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    server = subprocess.Popen([prefect, "server", "start", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        for _attempt in range(5):  # under load the API answers /health before it accepts writes
            pool = subprocess.run([prefect, "work-pool", "create", "securetrain-process", "--type", "process"],
                                  env=env, capture_output=True, text=True, timeout=120)
            if pool.returncode == 0:
                break
            time.sleep(3)
        assert pool.returncode == 0, pool.stdout[-1500:] + pool.stderr[-1500:]
        deployer = {**env, "SECURETRAIN_AUDIT_URL": "postgresql+psycopg://w:Deployer-Pa55@db/x",
                    "SECURETRAIN_HOME": "/home/deployer-only"}
        proc = subprocess.run([prefect, "--no-prompt", "deploy", "--all"], env=deployer, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        stored = subprocess.run([prefect, "deployment", "inspect", "secure_training/secure-training-nightly",
                                 "--output", "json"], env=env, capture_output=True, text=True, timeout=120)
        if stored.returncode != 0:  # older CLIs have no --output
            stored = subprocess.run([prefect, "deployment", "inspect", "secure_training/secure-training-nightly"],
                                    env=env, capture_output=True, text=True, timeout=120, check=True)
        text = stored.stdout
        assert "secure-training-nightly" in text
        assert "Deployer-Pa55" not in text and "deployer-only" not in text
        assert "set_working_directory_from_env" in text
    finally:
        server.terminate()
        server.wait(timeout=30)

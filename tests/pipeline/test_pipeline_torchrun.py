"""The train stage on several processes: `securetrain run` launches torchrun (2 gloo ranks on CPU)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from securetrain.pipeline.config import load_pipeline_config
from securetrain.pipeline.launch import torchrun_command

from .pipeline_fixtures import ROOT, small_config_data

# A user model whose rank 0 sends SIGTERM to the pipeline stage (torchrun's parent) on its 3rd
# training forward when KILL_STAGE=1: the preemption arrives where an operator's would.
KILLER_MODEL = '''
import os, signal
from torch import nn

class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                  nn.Linear(8, num_classes))
        self.calls = 0

    def forward(self, x):
        # Training forwards only: the pipeline's model check and the pre-training validation check
        # run the model in eval mode first (counting them made the kill land in step 1).
        self.calls += self.training
        if self.training and self.calls == 2 and os.environ.get("RANK") == "0" and os.environ.get("KILL_STAGE") == "1":
            with open(f"/proc/{os.getppid()}/stat") as fh:  # torchrun's parent: the stage
                stage = int(fh.read().rsplit(")", 1)[1].split()[1])
            os.kill(stage, signal.SIGTERM)
        return self.body(x)

def build(num_classes):
    return Net(num_classes)
'''


@pytest.fixture(autouse=True)
def _no_operator_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Demo secrets only: another test may have exported a passphrase into this process."""
    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_KEYRING_PASSPHRASE", "SECURETRAIN_KEK", "SECURETRAIN_DEID_KEY",
                "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(var, raising=False)


def _cli(config: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-m", "securetrain", "run", str(config), "--no-prefect"],
                          capture_output=True, text=True, env=full, timeout=240, cwd=config.parent)


def _config(tmp_path: Path, name: str, **training) -> Path:
    data = small_config_data(tmp_path, name=name, training={"nproc_per_node": 2, **training}, he={"enabled": False})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_run_trains_on_two_ranks_with_encrypted_checkpoints(tmp_path: Path) -> None:
    config = _config(tmp_path, "ddp")
    proc = _cli(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launching torchrun: 2 process(es) x 1 node(s)" in proc.stderr
    assert "[rank 0/2] step 1/" in proc.stderr  # the ranks' log lines, streamed by the stage
    run_dir = tmp_path / "runs" / "ddp"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["training"]["strategy"] == "ddp"
    assert result["audit"]["verified"] is True
    assert [c["step"] for c in result["training"]["checkpoints"]][-1] == result["training"]["steps"]
    # Encrypted under the run's keyring (the ranks resolved the secrets themselves), one file per step.
    from securetrain.crypto.checkpoint import EncryptedCheckpointStore
    from securetrain.pipeline.secrets import load_run_secrets

    cfg = load_pipeline_config(config)
    store = EncryptedCheckpointStore(run_dir / "checkpoints", load_run_secrets(cfg).keyring)
    loaded = store.load()
    assert loaded.info.step == result["training"]["steps"] and any(k.startswith("model/") for k in loaded.tensors)
    assert not list(run_dir.rglob("*.safetensors"))  # nothing plaintext from any rank
    assert not list((run_dir / "train" / "launch").iterdir())  # request and status removed
    # Exactly one training.start, recorded by rank 0 with the world size; the chain verifies.
    from securetrain.pipeline.runner import open_run_audit

    with open_run_audit(cfg) as audit:
        entries = list(audit.entries())
        assert audit.verify().ok
    starts = [e for e in entries if e.action == "training.start"]
    assert len(starts) == 1 and starts[0].details["world_size"] == 2
    assert sum(e.action == "checkpoint.write" for e in entries) >= len(result["training"]["checkpoints"])


@pytest.mark.slow
def test_run_with_fsdp_writes_a_shard_per_rank_and_the_model_reassembles(tmp_path: Path) -> None:
    config = _config(tmp_path, "fsdp", strategy="fsdp")
    proc = _cli(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "fsdp"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["training"]["strategy"] == "fsdp"
    shards = sorted(p.relative_to(run_dir / "checkpoints").as_posix()
                    for p in (run_dir / "checkpoints" / "shards").rglob("*.stenc"))
    last = result["training"]["steps"]
    assert f"shards/rank-00000/step-{last:012d}.stenc" in shards and f"shards/rank-00001/step-{last:012d}.stenc" in shards
    from securetrain.pipeline.secrets import load_run_secrets
    from securetrain.pipeline.stages import load_trained_model

    cfg = load_pipeline_config(config)
    model = load_trained_model(cfg, load_run_secrets(cfg), which="last")  # assembled from both shards
    assert sum(p.numel() for p in model.parameters()) == result["training"]["parameters"]


@pytest.mark.slow
def test_preemption_of_the_stage_is_forwarded_then_the_rerun_resumes(tmp_path: Path) -> None:
    (tmp_path / "killer.py").write_text(KILLER_MODEL)
    config = _config(tmp_path, "pre", checkpoint_every=100, stop_check_every=1)
    data = yaml.safe_load(config.read_text())
    data["model"] = {"target": "killer:build"}
    config.write_text(yaml.safe_dump(data))

    first = _cli(config, KILL_STAGE="1")
    assert first.returncode == 75, first.stdout[-3000:] + first.stderr[-3000:]
    # The step in flight finished, then every rank stopped after the same step: the signal is sent
    # during step 2 and travels stage -> torchrun -> ranks, so on a loaded machine a rank may see it
    # only after a later step (seen in CI-like runs); all ranks still agree on one step.
    stopped = re.search(r"preempted at step (\d+)", first.stderr)
    assert stopped, first.stderr[-3000:]
    k = int(stopped.group(1))
    assert k >= 2
    run_dir = tmp_path / "runs" / "pre"
    assert not (run_dir / "result.json").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.stenc")) == [f"step-{k:012d}.stenc"]

    second = _cli(config)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["training"]["reason"] == "completed"
    assert result["training"]["steps"] > k
    # Resumed, not restarted: the ranks' first logged step is k+1; the curve (checkpointed) is whole.
    assert "[rank 0/2] step 1/" not in second.stderr and f"[rank 0/2] step {k + 1}/" in second.stderr
    assert [s for s, _ in result["training"]["curve"]] == list(range(1, result["training"]["steps"] + 1))


def test_torchrun_command_carries_no_secret_and_the_rendezvous(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SECURETRAIN_KEYRING_PASSPHRASE", "correct horse battery staple")
    data = small_config_data(tmp_path, training={"nproc_per_node": 4, "nnodes": 2, "node_rank": 1,
                                                 "rdzv": {"endpoint": "node0:29400", "id": "job-7", "timeout_s": 600}})
    config = load_pipeline_config(data=data)
    cmd = torchrun_command(config, tmp_path / "request.json")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=node0:29400", "--rdzv-id=job-7",
            "--rdzv-backend=c10d", "--rdzv-conf=join_timeout=600"} <= set(cmd)
    assert "--standalone" not in cmd and cmd[-3:] == ["-m", "securetrain.pipeline.train_worker", str(tmp_path / "request.json")]
    assert not any("horse" in part for part in cmd)
    single = torchrun_command(load_pipeline_config(data=small_config_data(tmp_path, training={"nproc_per_node": 2})),
                              tmp_path / "r.json")
    assert "--standalone" in single and not any(a.startswith("--rdzv") for a in single)


@pytest.mark.parametrize("training, message", [
    ({"nnodes": 2}, "rdzv.endpoint"),
    ({"nnodes": 2, "rdzv": {"endpoint": "h:1"}, "node_rank": 2}, "node_rank"),
    ({"rdzv": {"endpoint": "h:1 --no-python"}}, "endpoint"),  # no argument injection through the config
])
def test_bad_launch_settings_fail_validation(tmp_path: Path, training, message) -> None:
    from securetrain.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message):
        load_pipeline_config(data=small_config_data(tmp_path, training=training))

"""Device backends: explicit choice, auto resolution with a stub Biren plugin, entry-point plugins.

Renaming PrivateUse1 is process-global and irreversible, so every test that does it runs in a
fresh subprocess with a fake ``torch_br`` (or a plain rename) on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from securetrain.devices import (
    BackendUnavailableError,
    CpuBackend,
    DeviceBackend,
    UnknownBackendError,
    all_backends,
    backend_names,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from securetrain.errors import DeviceError

FAKE_TORCH_BR = '''
import os, types, torch
torch.utils.rename_privateuse1_backend("supa")
supa = types.ModuleType("torch_br.supa")
supa.is_available = lambda: os.environ.get("FAKE_SUPA_AVAILABLE", "1") == "1"
supa.device_count = lambda: 1
supa.synchronize = lambda *a: None
supa.memory_allocated = lambda i=0: 1234
supa.memory_reserved = lambda i=0: 4096
torch._register_device_module("supa", supa)
if os.environ.get("FAKE_PATCH_CUDA") == "1":
    # torch_br makes CUDA-targeting code run on Biren by patching torch.cuda
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda i=0: "Biren BR104P"
if os.environ.get("FAKE_SCCL") == "1":
    import torch.distributed as dist
    dist.Backend.register_backend("sccl", lambda *a, **k: None, devices=["supa"])
if os.environ.get("FAKE_BROKEN") == "1":
    raise RuntimeError("driver mismatch")
'''


def _run(code: str, tmp: Path, env: dict[str, str] | None = None) -> dict:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE = """
import json, torch
from securetrain.devices import resolve_backend
b = resolve_backend("auto")
print(json.dumps({"name": b.name, "type": b.device().type, "device": str(b.device()),
    "dtype": str(b.autocast_dtype), "coll": b.collective_backend, "mult": b.batch_multiple,
    "pin": b.pin_memory, "mem": b.memory_summary(), "round": b.round_batch_size(130)}))
"""


@pytest.fixture
def fake_br(tmp_path: Path) -> Path:
    (tmp_path / "torch_br.py").write_text(FAKE_TORCH_BR)
    return tmp_path


def test_auto_picks_br_and_maps_to_supa(fake_br: Path) -> None:
    got = _run(PROBE, fake_br)
    assert got == {
        "name": "br", "type": "supa", "device": "supa:0", "dtype": "torch.bfloat16", "coll": "gloo",
        "mult": 128, "pin": True, "mem": {"allocated": 1234, "reserved": 4096}, "round": 256,
    }  # no Biren collective registered: gloo, never a name init_process_group would reject


def test_br_reports_sccl_only_when_registered(fake_br: Path) -> None:
    assert _run(PROBE, fake_br, {"FAKE_SCCL": "1"})["coll"] == "sccl"


def test_loader_worker_advice() -> None:
    assert CpuBackend().loader_workers() == 0  # host training: workers would fight the compute

    class Acc(CpuBackend):
        device_type = "fakeacc"
        max_loader_workers = 64

    cores = len(os.sched_getaffinity(0))
    assert Acc().loader_workers(1) == int(0.7 * cores)
    assert Acc().loader_workers(cores * 4) == 0  # many ranks per node: no over-subscription
    Acc.max_loader_workers = 0
    assert Acc().loader_workers(1) == 0  # capped


def test_patched_torch_cuda_is_not_mistaken_for_nvidia(fake_br: Path) -> None:
    code = PROBE.replace('b = resolve_backend("auto")', '''
import torch_br
from securetrain.errors import DeviceError
assert torch.cuda.is_available()  # the plugin lies on purpose
try:
    resolve_backend("cuda"); raise SystemExit("cuda accepted on a Biren machine")
except DeviceError as e:
    assert "cuda" in str(e)
b = resolve_backend("auto")''')
    assert _run(code, fake_br, {"FAKE_PATCH_CUDA": "1"})["name"] == "br"


def test_broken_or_absent_br_falls_back_to_cpu_for_auto_but_explicit_fails(fake_br: Path) -> None:
    assert _run(PROBE, fake_br, {"FAKE_BROKEN": "1"})["name"] == "cpu"
    code = """
import json
from securetrain.devices import resolve_backend, BackendUnavailableError
auto = resolve_backend("auto").name
try:
    resolve_backend("br"); print(json.dumps({"raised": False}))
except BackendUnavailableError as e:
    print(json.dumps({"raised": True, "msg": str(e), "auto": auto}))
"""
    got = _run(code, fake_br, {"FAKE_SUPA_AVAILABLE": "0"})
    assert got["raised"] and "is_available() is False" in got["msg"] and got["auto"] == "cpu"


def test_renamed_privateuse1_without_vendor_plugin(tmp_path: Path) -> None:
    code = """
import types, torch
torch.utils.rename_privateuse1_backend("fooacc")
m = types.ModuleType("fooacc"); m.is_available = lambda: True
torch._register_device_module("fooacc", m)
""" + PROBE
    got = _run(code, tmp_path)
    assert (got["name"], got["type"], got["device"]) == ("privateuse1", "fooacc", "fooacc:0")


def test_entry_point_plugin_registers_and_wins_for_its_device(tmp_path: Path) -> None:
    (tmp_path / "acme_backend.py").write_text(textwrap.dedent('''
        import torch
        from securetrain.devices import PrivateUse1Backend
        class AcmeBackend(PrivateUse1Backend):
            name = "acme"
            batch_multiple = 64
            def __init__(self, index=0):
                super().__init__(index, device_type="acmeu")
            @property
            def collective_backend(self):
                return "acmecl"
        def broken(index=0):
            raise RuntimeError("nope")
    '''))
    dist = tmp_path / "acme_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[securetrain.devices]\nacme = acme_backend:AcmeBackend\nbadone = acme_backend:missing_attr\n"
    )
    code = """
import torch
torch.utils.rename_privateuse1_backend("acmeu")
from securetrain.devices import backend_names
names = backend_names()
assert "acme" in names and "badone" not in names, names  # broken plugin skipped, not fatal
""" + PROBE
    got = _run(code, tmp_path)
    assert (got["name"], got["type"], got["coll"], got["mult"]) == ("acme", "acmeu", "acmecl", 64)


def test_unknown_backend_lists_known() -> None:
    with pytest.raises(UnknownBackendError) as exc:
        resolve_backend("tpu")
    assert isinstance(exc.value, DeviceError)
    for name in ("auto", "cpu", "cuda", "br"):
        assert name in str(exc.value)
    with pytest.raises(UnknownBackendError, match="index"):
        resolve_backend("cpu:x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_explicit_cuda_without_gpu_fails_closed() -> None:
    with pytest.raises(BackendUnavailableError, match="cuda") as exc:
        resolve_backend("cuda")
    assert "securetrain devices" in str(exc.value)


def test_cpu_backend_contract() -> None:
    b = resolve_backend("cpu")
    assert isinstance(b, CpuBackend) and b.device() == torch.device("cpu")
    assert b.autocast_dtype is None and "bf16" in b.supported_precisions  # fp32 default, bf16 opt-in
    assert (b.collective_backend, b.batch_multiple, b.pin_memory) == ("gloo", 1, False)
    mem = b.memory_summary()
    assert mem["total"] > 0 and mem["process_rss"] > 0
    b.synchronize()
    desc = b.describe().as_dict()
    assert desc["available"] and desc["device"] == "cpu" and desc["reason"] is None
    if not torch.cuda.is_available():
        assert resolve_backend("auto").name == "cpu"


def test_register_backend_guards() -> None:
    with pytest.raises(ValueError):
        register_backend("cpu", CpuBackend)
    with pytest.raises(ValueError):
        register_backend("auto", CpuBackend)

    class Weird(CpuBackend):
        name = "weird_test_backend"

    try:
        register_backend("weird_test_backend", Weird)
        with pytest.raises(ValueError, match="already registered"):
            register_backend("weird_test_backend", Weird)
        assert "weird_test_backend" in backend_names()
        assert isinstance(resolve_backend("weird_test_backend"), DeviceBackend)
        register_backend("not_a_backend_test", lambda i: object())  # type: ignore[arg-type,return-value]
        with pytest.raises(UnknownBackendError):
            resolve_backend("not_a_backend_test")
    finally:
        unregister_backend("weird_test_backend")
        unregister_backend("not_a_backend_test")
    assert "weird_test_backend" not in backend_names()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.cuda is None, reason="needs an NVIDIA GPU")
def test_cuda_backend_on_real_gpu(tmp_path: Path) -> None:
    b = resolve_backend("cuda")
    assert b.device().type == "cuda" and b.batch_multiple == 8 and b.collective_backend == "nccl"
    assert b.autocast_dtype in (torch.bfloat16, torch.float16)
    assert resolve_backend("auto").name == "cuda"
    assert {"allocated", "total", "free"} <= set(b.memory_summary())
    from securetrain.training import Trainer, TrainingConfig
    from securetrain.training.synthetic import SyntheticClassification, make_mlp

    model = make_mlp(8, 3, seed=0)
    r = Trainer(model, SyntheticClassification(64, 8, 3), TrainingConfig(max_steps=4, batch_size=8, device="cuda",
                output_dir=tmp_path)).fit()
    assert r.device.startswith("cuda") and r.steps == 4 and next(model.parameters()).is_cuda


class _RaisingProbe(CpuBackend):
    """A third-party backend that breaks the 'availability() must not raise' contract."""

    name = "raising_probe_test"

    def availability(self) -> tuple[bool, str | None]:
        raise RuntimeError("driver query exploded")


def _raising_factory(index: int) -> DeviceBackend:
    raise RuntimeError("factory exploded")


def test_broken_plugin_backend_is_reported_not_raised() -> None:
    """One broken plugin (probe or factory raising, factory returning junk) must not break listing or
    auto for everyone, and choosing it explicitly fails with a DeviceError naming the cause."""
    register_backend("raising_probe_test", _RaisingProbe)
    register_backend("raising_factory_test", _raising_factory)
    register_backend("junk_factory_test", lambda i: object())  # type: ignore[arg-type,return-value]
    try:
        by_name = {b.name: b for b in (x.describe() for x in all_backends())}
        for name, cause in (("raising_probe_test", "driver query exploded"),
                            ("raising_factory_test", "factory exploded"),
                            ("junk_factory_test", "did not return a DeviceBackend")):
            assert not by_name[name].available and cause in str(by_name[name].reason)
        assert by_name["cpu"].available
        assert not _RaisingProbe().is_available()
        with pytest.raises(BackendUnavailableError, match="driver query exploded"):
            resolve_backend("raising_probe_test")
        with pytest.raises(BackendUnavailableError, match="factory exploded"):
            resolve_backend("raising_factory_test:1")
        if not torch.cuda.is_available():
            assert resolve_backend("auto").name == "cpu"
    finally:
        for name in ("raising_probe_test", "raising_factory_test", "junk_factory_test"):
            unregister_backend(name)


def test_cuda_index_beyond_visible_devices_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.devices import CudaBackend

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100")
    ok, reason = CudaBackend(3).availability()
    assert not ok and "cuda:3" in str(reason) and "2 CUDA device" in str(reason)
    assert CudaBackend(1).availability() == (True, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "is_available() is False" in str(CudaBackend(0).availability()[1])

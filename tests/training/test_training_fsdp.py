"""FSDP2 on 2 gloo ranks (CPU): sharded encrypted checkpoints, one manifest, bit-identical resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tensor_digest import digest_tensors as _digest
from torch import nn
from two_ranks import run_two_ranks

from securetrain.crypto.checkpoint import EncryptedCheckpointStore
from securetrain.crypto.errors import BindingError, DigestMismatchError, SegmentAuthError
from securetrain.training import ResumeMismatchError, Trainer, TrainingConfig, sharded
from securetrain.training.synthetic import SyntheticClassification, make_mlp

WORKER = Path(__file__).with_name("fsdp_worker.py")
KEK = os.urandom(32).hex()



@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory, ) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    run_two_ranks(WORKER, out, timeout=300, env={"SECURETRAIN_KEK": KEK, "SECURETRAIN_KEK_ID": "test-kek"},
                  unset=("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"))
    return out


@pytest.fixture
def kek(monkeypatch: pytest.MonkeyPatch) -> EncryptedCheckpointStore:
    monkeypatch.setenv("SECURETRAIN_KEK", KEK)
    monkeypatch.setenv("SECURETRAIN_KEK_ID", "test-kek")
    for name in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(name, raising=False)


def _store(path: Path) -> EncryptedCheckpointStore:
    return EncryptedCheckpointStore.from_env(path)


@pytest.mark.slow
def test_fsdp_resume_is_bit_identical_on_every_shard(fsdp_run: Path, kek) -> None:
    full = [(fsdp_run / "full" / f"rank{r}.sha256").read_text().split() for r in (0, 1)]
    assert full[0][1:] == full[1][1:] == ["8", "completed"]
    assert full[0][0] != full[1][0]  # each rank holds a different shard
    resumed = [(fsdp_run / "resumed" / f"rank{r}.sha256").read_text().split() for r in (0, 1)]
    assert resumed == full  # stopped at step 3 (mid-epoch), resumed on a fresh model: bit-identical shards
    assert (fsdp_run / "resumed" / "full.sha256").read_text() == (fsdp_run / "full" / "full.sha256").read_text()


@pytest.mark.slow
def test_every_rank_writes_an_encrypted_shard_bound_by_one_manifest(fsdp_run: Path, kek) -> None:
    ckpts = fsdp_run / "full" / "checkpoints"
    store = _store(ckpts)
    assert [i.step for i in store.list()] == [4, 8]
    manifest = store.load()
    assert manifest.metadata["securetrain.train.format"] == sharded.MANIFEST_FORMAT
    world, infos = sharded.shard_infos(manifest.metadata, ckpts)
    assert world == 2 and [i.path.parent.name for i in infos] == ["rank-00000", "rank-00001"]
    assert all(i.path.suffix == ".stenc" and i.step == 8 and i.key_id == "test-kek" for i in infos)
    assert not list(fsdp_run.rglob("*.safetensors"))  # nothing in plaintext, from any rank
    assert not any(k.startswith("model/") for k in manifest.tensors)  # rank 0 gathered nothing
    shard0 = store.shard_store(0).load(infos[0])
    assert {k for k in shard0.tensors if k.startswith("rng/")} and any(k.startswith("optim/") for k in shard0.tensors)
    # The shards reassemble (dim-0 concatenation in rank order) into exactly the gathered weights.
    weights = {k.removeprefix("model/"): v for k, v in sharded.assemble_full(store, manifest).items()}
    assert _digest(weights) == (fsdp_run / "full" / "full.sha256").read_text().strip()
    assert weights["0.weight"].shape == (16, 10)
    model = make_mlp(10, 3, hidden=16, dropout=0.1, seed=0)
    model.load_state_dict(weights)  # loadable without FSDP
    best = _store(fsdp_run / "full" / "best").load()
    assert set(best.tensors) == {f"model/{k}" for k in model.state_dict()}  # the best weights, gathered in full


@pytest.mark.slow
def test_tied_weights_stay_tied_under_fsdp_and_resume_bit_identically(fsdp_run: Path, kek) -> None:
    """An output projection that is the embedding matrix: FSDP2 refused it ("shared with a parameter
    already managed by another FSDP group") since every child was sharded on its own. Children that
    share a parameter are one FSDP group now: the tie holds, the shard is written once, resume is exact."""
    from tied_net import TiedNet

    full = [(fsdp_run / "tied" / f"rank{r}.sha256").read_text().split() for r in (0, 1)]
    assert full[0][1:] == full[1][1:] == ["8", "completed", "True"]  # the tie held after training
    resumed = [(fsdp_run / "tied-resumed" / f"rank{r}.sha256").read_text().split() for r in (0, 1)]
    assert resumed == full
    assert (fsdp_run / "tied-resumed" / "full.sha256").read_text() == (fsdp_run / "tied" / "full.sha256").read_text()
    store = _store(fsdp_run / "tied" / "checkpoints")
    manifest = store.load()
    _, infos = sharded.shard_infos(manifest.metadata, fsdp_run / "tied" / "checkpoints")
    shard0 = store.shard_store(0).load(infos[0])
    assert shard0.tensors["model/head.weight"] is shard0.tensors["model/embed.weight"]  # written once
    weights = {k.removeprefix("model/"): v for k, v in sharded.assemble_full(store, manifest).items()}
    model = TiedNet(5)
    model.load_state_dict(weights)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, weights["embed.weight"])


def test_shard_groups_put_tied_children_together() -> None:
    from tied_net import TiedNet

    model = TiedNet(0)
    assert [[type(m).__name__ for m in g] for g in sharded.shard_groups(model)] == [["Linear"], ["Embedding", "Linear"]]
    shared_with_root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    shared_with_root.w = shared_with_root[1].weight  # a root parameter: the root's group holds it
    assert sharded.shard_groups(shared_with_root) == [[shared_with_root[0]]]


@pytest.mark.slow
def test_swapped_or_altered_shards_are_refused(fsdp_run: Path, kek, tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(fsdp_run / "full" / "checkpoints", ckpts)
    store = _store(ckpts)
    manifest = store.load()
    _, infos = sharded.shard_infos(manifest.metadata, ckpts)
    a, b = infos[0].path, infos[1].path
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    with pytest.raises((BindingError, DigestMismatchError)):
        sharded.assemble_full(store, manifest)
    a.write_bytes(data_a)
    b.write_bytes(data_b[:-1] + bytes([data_b[-1] ^ 1]))
    with pytest.raises((DigestMismatchError, SegmentAuthError)):
        sharded.assemble_full(store, manifest)


@pytest.mark.slow
def test_resume_on_another_world_size_is_a_clear_error(fsdp_run: Path, kek, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(fsdp_run / "full" / "checkpoints", out / "checkpoints")
    cfg = TrainingConfig(epochs=3, batch_size=8, grad_accumulation=2, seed=3, output_dir=out, strategy="fsdp")
    trainer = Trainer(make_mlp(10, 3, hidden=16, seed=0), SyntheticClassification(samples=100, features=10, classes=3,
                                                                                   seed=5), cfg)
    with pytest.raises(ResumeMismatchError, match="world_size: checkpoint 2 vs now 1|FSDP-sharded"):
        trainer.fit()


def test_manifest_paths_cannot_escape_the_store(tmp_path: Path) -> None:
    from securetrain.training.errors import CheckpointCorruptError

    for entry in ({"rank": 0, "file": "../../etc/x", "step": 1, "sha256": "0"},
                  {"rank": 1, "file": "shards/rank-00000/step-1", "step": 1, "sha256": "0"}):
        meta = {sharded.SHARDS_KEY: json.dumps({"world_size": 1, "shards": [entry]})}
        with pytest.raises(CheckpointCorruptError):
            sharded.shard_infos(meta, tmp_path)
    meta = {sharded.SHARDS_KEY: json.dumps({"world_size": 2, "shards": [
        {"rank": 0, "file": "a", "step": 1, "sha256": "0"}]})}
    with pytest.raises(CheckpointCorruptError, match="world size 2"):
        sharded.shard_infos(meta, tmp_path)


def test_fsdp_refuses_fp16_and_a_prebuilt_optimizer(tmp_path: Path) -> None:
    from securetrain.devices import CpuBackend
    from securetrain.training import TrainingError

    model = make_mlp(4, 2, hidden=4, seed=0)
    trainer = Trainer(model, SyntheticClassification(samples=8, features=4, classes=2),
                      TrainingConfig(output_dir=tmp_path, strategy="fsdp"),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), backend=CpuBackend())
    with pytest.raises(TrainingError, match="fp16"):
        trainer._check_fsdp("fp16")
    with pytest.raises(TrainingError, match="optimizer factory"):
        trainer._check_fsdp("fp32")


def test_store_id_written_by_a_concurrent_opener_is_awaited_not_malformed(tmp_path: Path, kek) -> None:
    """Every rank opens the same store: one creates .store-id, the others must wait for its content."""
    import threading
    import time

    folder = tmp_path / "store"
    folder.mkdir()
    (folder / ".store-id").touch(mode=0o600)  # created by the "other rank", id not yet written

    def finish() -> None:
        time.sleep(0.3)
        (folder / ".store-id").write_text("store-abc\n")

    writer = threading.Thread(target=finish)
    writer.start()
    store = _store(folder)
    writer.join()
    assert store.store_id == "store-abc"
    (folder / ".store-id").write_text("bad id!\n")
    from securetrain.crypto.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="malformed"):
        _store(folder)

"""Weight tying survives trainer checkpoints: the tied matrix is written once, and a resumed run keeps
the tie (one Parameter under both names) and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import tied_net
import torch
from safetensors import safe_open
from torch import nn

from securetrain.crypto.checkpoint import EncryptedCheckpointStore
from securetrain.crypto.keys import LocalKeyring, SecretKey
from securetrain.training import SafetensorsCheckpointStore, Trainer, TrainingConfig
from securetrain.training import state as st
from securetrain.training.synthetic import SyntheticClassification

torch.set_num_threads(1)


#: The shared tied model, on this file's data (8 features).
TiedNet = functools.partial(tied_net.TiedNet, in_features=8, dropout=0.3)


def _data() -> SyntheticClassification:
    return SyntheticClassification(samples=80, features=8, classes=3, seed=2)


def _cfg(tmp: Path, **kw) -> TrainingConfig:  # noqa: ANN003
    base = dict(epochs=2, batch_size=8, grad_accumulation=2, lr=5e-3, seed=4, output_dir=tmp, log_every=1,
                device="cpu")
    return TrainingConfig(**(base | kw))


def test_snapshot_keeps_ties_and_copies() -> None:
    m = TiedNet(1)
    snap = st.snapshot_tensors(m.state_dict())
    assert list(snap) == list(m.state_dict())
    assert snap["head.weight"] is snap["embed.weight"]
    assert snap["inp.weight"].data_ptr() != m.inp.weight.data_ptr()  # a copy, not the live parameter
    assert snap["embed.weight"].data_ptr() != m.embed.weight.data_ptr()


def test_tied_model_checkpoint_writes_the_tie_once_and_resumes_bit_identically(tmp_path: Path) -> None:
    ref = TiedNet(1)
    Trainer(ref, _data(), _cfg(tmp_path / "ref")).fit()

    model = TiedNet(1)
    first = Trainer(model, _data(), _cfg(tmp_path / "run", max_steps=3)).fit()
    assert first.steps == 3 and first.checkpoint is not None
    with safe_open(str(first.checkpoint.path), framework="pt") as f:
        names = set(f.keys())
        aliases = json.loads(f.metadata()["securetrain.aliases"])
    assert "model/embed.weight" in names and "model/head.weight" not in names  # written once
    assert aliases == {"model/head.weight": "model/embed.weight"}
    loaded = SafetensorsCheckpointStore(tmp_path / "run/checkpoints").load()
    assert loaded.tensors["model/head.weight"] is loaded.tensors["model/embed.weight"]
    assert "securetrain.aliases" not in loaded.metadata

    fresh = TiedNet(99)  # different init: resume must overwrite it
    torch.manual_seed(12345)
    second = Trainer(fresh, _data(), _cfg(tmp_path / "run")).fit()
    assert second.resumed_from == 3 and second.steps == 10
    assert fresh.head.weight is fresh.embed.weight  # the tie holds after loading and training
    for k, v in ref.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def test_tied_model_encrypted_checkpoint_keeps_the_tie(tmp_path: Path) -> None:
    ring = LocalKeyring([SecretKey("train-kek", os.urandom(32))], "train-kek")
    ref = TiedNet(1)
    Trainer(ref, _data(), _cfg(tmp_path / "ref")).fit()

    def run(model: nn.Module, max_steps: int | None):  # noqa: ANN202
        store = EncryptedCheckpointStore(tmp_path / "ckpt", ring, keep_last=2)
        return Trainer(model, _data(), _cfg(tmp_path / "out", max_steps=max_steps), store=store).fit(), store

    first, store = run(TiedNet(1), 3)
    loaded = store.load()
    assert loaded.tensors["model/head.weight"] is loaded.tensors["model/embed.weight"]
    fresh = TiedNet(7)
    second, _ = run(fresh, None)
    assert second.resumed_from == 3
    assert fresh.head.weight is fresh.embed.weight
    for k, v in ref.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k

"""The training engine checkpoints through EncryptedCheckpointStore and resumes from it."""

from __future__ import annotations

import os

import torch
from torch.utils.data import TensorDataset

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.crypto._container import inspect_file
from securetrain.crypto.checkpoint import EncryptedCheckpointStore
from securetrain.crypto.keys import LocalKeyring, SecretKey
from securetrain.training.config import TrainingConfig
from securetrain.training.trainer import Trainer


def test_trainer_checkpoints_encrypted_and_resumes(tmp_path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    ring = LocalKeyring([SecretKey("train-kek", os.urandom(32))], "train-kek")
    audit = MemoryAuditRecorder()
    store = EncryptedCheckpointStore(tmp_path / "ckpt", ring, audit=audit, keep_last=2)

    def trainer(max_steps: int) -> Trainer:
        cfg = TrainingConfig(max_steps=max_steps, epochs=None, batch_size=8, checkpoint_every=2,
                             device="cpu", output_dir=tmp_path / "out", log_every=1)
        return Trainer(torch.nn.Linear(8, 3), data, cfg, store=store, audit=audit)

    first = trainer(4).fit()
    assert first.steps == 4 and first.checkpoint is not None and first.checkpoint.key_id == "train-kek"
    raw = first.checkpoint.path.read_bytes()
    assert raw.startswith(b"\x89STENC\r\n") and b"weight" not in raw, "tensor names/bytes must be encrypted"
    assert inspect_file(first.checkpoint.path).key_ids == ["train-kek"]
    writes = [e for e in audit.events if e["action"] == "checkpoint.write"]
    assert writes and all(e["details"]["key_id"] == "train-kek" for e in writes)

    second = trainer(6).fit()
    assert second.resumed_from == 4 and second.steps == 6
    assert [i.step for i in store.list()] == [4, 6]


def test_resume_falls_back_past_a_corrupted_latest_checkpoint(tmp_path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    ring = LocalKeyring([SecretKey("train-kek", os.urandom(32))], "train-kek")
    audit = MemoryAuditRecorder()
    store = EncryptedCheckpointStore(tmp_path / "ckpt", ring, audit=audit)

    def trainer(max_steps: int) -> Trainer:
        cfg = TrainingConfig(max_steps=max_steps, epochs=None, batch_size=8, checkpoint_every=2,
                             device="cpu", output_dir=tmp_path / "out", log_every=1)
        return Trainer(torch.nn.Linear(8, 3), data, cfg, store=store, audit=audit)

    trainer(4).fit()
    latest = store.path_for(4)
    blob = bytearray(latest.read_bytes())
    blob[-40] ^= 1  # a flipped bit in the last segment (disk error, torn copy)
    latest.write_bytes(bytes(blob))
    resumed = trainer(6).fit()
    assert resumed.resumed_from == 2 and resumed.steps == 6
    skips = [e for e in audit.events if e["action"] == "checkpoint.skip"]
    assert skips and skips[-1]["resource"] == latest.name
    assert skips[-1]["details"] == {"step": 4, "error": "SegmentAuthError", "fallback_step": 2}

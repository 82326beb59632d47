"""SafetensorsCheckpointStore: atomic, step-named, keep_last, no pickle, detects tampering/truncation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from securetrain.errors import IntegrityError
from securetrain.training import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStore,
    SafetensorsCheckpointStore,
)


def _tensors(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), v), "b": torch.arange(3, dtype=torch.int64)}


def test_roundtrip_and_protocol(tmp_path: Path) -> None:
    store = SafetensorsCheckpointStore(tmp_path)
    assert isinstance(store, CheckpointStore)
    assert store.latest() is None and store.list() == []
    info = store.save(7, _tensors(1.5), {"note": "x"})
    assert info.path.name == "step-00000007.safetensors" and info.key_id is None
    assert info.path.stat().st_mode & 0o077 == 0  # owner-only
    loaded = store.load(info)
    assert torch.equal(loaded.tensors["w"], _tensors(1.5)["w"])
    assert loaded.metadata["note"] == "x" and loaded.info.sha256 == info.sha256
    assert store.load().info == info  # default: latest


def test_file_is_plain_safetensors_not_pickle(tmp_path: Path) -> None:
    info = SafetensorsCheckpointStore(tmp_path).save(1, _tensors(0.0), {})
    head = info.path.read_bytes()[:16]
    assert not head.startswith(b"\x80") and b"PK" not in head[:2]  # neither pickle nor torch zip
    assert info.path.read_bytes()[8:9] == b"{"  # u64 header length, then the JSON header


def test_keep_last_and_ordering(tmp_path: Path) -> None:
    store = SafetensorsCheckpointStore(tmp_path, keep_last=2)
    for step in (3, 10, 1000, 20):
        store.save(step, _tensors(step), {})
    assert [i.step for i in store.list()] == [20, 1000]  # numeric, not lexical, order
    assert store.latest().step == 1000
    (tmp_path / ".step-00009999.safetensors.123.tmp").write_bytes(b"partial")  # a crashed writer
    (tmp_path / "notes.txt").write_text("ignored")
    assert [i.step for i in store.list()] == [20, 1000]


def test_tampered_bytes_detected_against_recorded_digest(tmp_path: Path) -> None:
    store = SafetensorsCheckpointStore(tmp_path)
    info = store.save(5, _tensors(2.0), {})
    data = bytearray(info.path.read_bytes())
    data[-1] ^= 0x01  # flip one bit of tensor data: still parses, digest must catch it
    info.path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="changed on disk") as exc:
        store.load(info)
    assert isinstance(exc.value, IntegrityError)


@pytest.mark.parametrize("cut", [0, 4, 8, 40, -3])
def test_truncated_or_garbage_file_is_typed_error(tmp_path: Path, cut: int) -> None:
    store = SafetensorsCheckpointStore(tmp_path)
    info = store.save(2, _tensors(2.0), {})
    info.path.write_bytes(info.path.read_bytes()[:cut])
    with pytest.raises(CheckpointCorruptError):
        store.load()


def test_huge_header_length_rejected(tmp_path: Path) -> None:
    store = SafetensorsCheckpointStore(tmp_path)
    info = store.save(2, _tensors(2.0), {})
    info.path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointCorruptError):
        store.load()


def test_renamed_file_step_mismatch(tmp_path: Path) -> None:
    store = SafetensorsCheckpointStore(tmp_path)
    info = store.save(2, _tensors(2.0), {})
    info.path.rename(tmp_path / "step-00000009.safetensors")  # replay an old checkpoint as "newer"
    with pytest.raises(CheckpointCorruptError, match="claims step"):
        store.load()


def test_missing(tmp_path: Path) -> None:
    store = SafetensorsCheckpointStore(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError):
        store.load()
    info = SafetensorsCheckpointStore(tmp_path).save(1, _tensors(1), {})
    info.path.unlink()
    with pytest.raises(CheckpointNotFoundError):
        store.load(dataclasses.replace(info))


def test_failed_write_leaves_previous_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SafetensorsCheckpointStore(tmp_path)
    good = store.save(1, _tensors(1.0), {})
    import securetrain.io.atomic as atomic

    def boom(*a, **k):  # noqa: ANN002, ANN003
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError):
        store.save(2, _tensors(2.0), {})
    monkeypatch.undo()
    assert [i.step for i in store.list()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.path.name]

"""seal_tensors / open_tensors: the one-call recipe, including the attacks it must refuse."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from securetrain.crypto import (
    CryptoError,
    DigestMismatchError,
    KeyNotFoundError,
    LocalKeyring,
    OpenedTensors,
    SealedFile,
    SegmentAuthError,
    TruncatedError,
    open_tensors,
    seal_tensors,
)


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(8, 3, 3, 3, generator=g), "fc.bias": torch.arange(10, dtype=torch.float64),
            "step": torch.tensor(7, dtype=torch.int64)}


def test_round_trip(tmp_path: Path, state: dict[str, torch.Tensor]) -> None:
    ring = LocalKeyring.create()
    sealed = seal_tensors(state, tmp_path / "m.stenc", ring, metadata={"epoch": "3"})
    assert isinstance(sealed, SealedFile) and sealed.key_id == ring.current_key_id()
    assert sealed.size == (tmp_path / "m.stenc").stat().st_size and sealed.tensor_count == 3
    assert (tmp_path / "m.stenc").stat().st_mode & 0o077 == 0  # owner-only
    opened = open_tensors(sealed.path, ring, expect_sha256=sealed.sha256)
    assert isinstance(opened, OpenedTensors) and opened.sha256 == sealed.sha256
    assert set(opened.tensors) == set(state)
    for name, tensor in state.items():
        assert torch.equal(opened.tensors[name], tensor) and opened.tensors[name].dtype == tensor.dtype
    assert opened.metadata["epoch"] == "3"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opened.sha256 = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        opened.tensors["x"] = torch.zeros(1)  # type: ignore[index]


def test_the_file_holds_no_plaintext_and_no_pickle(tmp_path: Path) -> None:
    marker = torch.frombuffer(bytearray(b"PLAINTEXT-MARKER" * 64), dtype=torch.uint8)
    sealed = seal_tensors({"marker_tensor_name": marker}, tmp_path / "m.stenc", LocalKeyring.create())
    raw = sealed.path.read_bytes()
    assert b"PLAINTEXT-MARKER" not in raw and b"marker_tensor_name" not in raw


def test_wrong_keyring_is_refused(tmp_path: Path, state: dict[str, torch.Tensor]) -> None:
    sealed = seal_tensors(state, tmp_path / "m.stenc", LocalKeyring.create())
    with pytest.raises(KeyNotFoundError):
        open_tensors(sealed.path, LocalKeyring.create())


def test_tampered_and_truncated_files_are_refused(tmp_path: Path, state: dict[str, torch.Tensor]) -> None:
    ring = LocalKeyring.create()
    sealed = seal_tensors(state, tmp_path / "m.stenc", ring)
    raw = bytearray(sealed.path.read_bytes())
    raw[-40] ^= 1
    (tmp_path / "flipped.stenc").write_bytes(raw)
    with pytest.raises(SegmentAuthError):
        open_tensors(tmp_path / "flipped.stenc", ring)
    (tmp_path / "cut.stenc").write_bytes(sealed.path.read_bytes()[:-50])
    with pytest.raises(CryptoError) as cut:
        open_tensors(tmp_path / "cut.stenc", ring)
    assert isinstance(cut.value, (TruncatedError, SegmentAuthError))


def test_pinned_digest_refuses_another_authentic_file(tmp_path: Path, state: dict[str, torch.Tensor]) -> None:
    ring = LocalKeyring.create()
    first = seal_tensors(state, tmp_path / "a.stenc", ring)
    seal_tensors({"other": torch.ones(2)}, tmp_path / "b.stenc", ring)
    os.replace(tmp_path / "b.stenc", tmp_path / "a.stenc")  # an authentic file under the same key
    with pytest.raises(DigestMismatchError):
        open_tensors(tmp_path / "a.stenc", ring, expect_sha256=first.sha256)


def test_a_failed_seal_keeps_the_existing_file(tmp_path: Path, state: dict[str, torch.Tensor]) -> None:
    ring = LocalKeyring.create()
    sealed = seal_tensors(state, tmp_path / "m.stenc", ring)
    before = sealed.path.read_bytes()
    with pytest.raises(CryptoError):
        seal_tensors(state, sealed.path, ring, key_id="kek-does-not-exist")
    assert sealed.path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.stenc"]  # no temp left behind

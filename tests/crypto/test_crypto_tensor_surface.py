"""The tensor surface of every sealing path (seal_tensors, the checkpoint store, transport v1/v2,
the Prefect serializer), probed like an outside tester would: every torch dtype, views and
layouts, devices, shared storage (tied weights), odd keys and values.

The contract: a tensor round-trips bit-exactly (dtype, shape, every byte: NaN payloads, -0.0,
inf), or it is refused with :class:`UnsupportedTensorError` (a ``CryptoError``) that names the
key and the dtype and says what to do - before a single byte is written (no file, no message).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from securetrain.audit.recorder import MemoryAuditRecorder
from securetrain.crypto import (
    CryptoError,
    EncryptedCheckpointStore,
    LocalKeyring,
    SecretKey,
    UnsupportedTensorError,
    open_tensors,
    seal_tensors,
)
from securetrain.crypto import transport as T

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
SUPPORTED = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
    torch.complex64,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool,
}
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
PATHS = ("seal_tensors", "store", "transport_v2", "transport_v1")


@pytest.fixture(scope="module")
def ring() -> LocalKeyring:
    return LocalKeyring([SecretKey("surface-kek", bytes(range(32)))], "surface-kek")


@pytest.fixture(scope="module")
def parties() -> tuple[T.TensorSealer, T.TensorSealer, T.TensorOpener]:
    alice, bob = T.TransportIdentity.generate("alice"), T.TransportIdentity.generate("bob")
    return (T.TensorSealer(alice, "bob", bob.public_bytes()),
            T.TensorSealer(alice, "bob", bob.public_bytes(), version=1),
            T.TensorOpener(bob, {"alice": alice.public_bytes()}))


class _Wire:
    """Stands in for a socket: records what ``TensorSealer.send`` emits."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def sendall(self, data: Any) -> None:
        self.chunks.append(bytes(data))


Opened = dict[str, torch.Tensor]


def _seal_and_open(path: str, tensors: Mapping[Any, Any], tmp_path: Path, ring: LocalKeyring, parties: Any,
                   metadata: Mapping[Any, Any] | None = None) -> tuple[Opened, Callable[[], list[str]]]:
    """Seal ``tensors`` through ``path`` and open the result; also returns what was left behind
    (files in the output directory, or the bytes on the wire) for the refusal checks."""
    sealer2, sealer1, opener = parties
    out = tmp_path / path
    out.mkdir()
    if path == "seal_tensors":
        def leftovers() -> list[str]:
            return sorted(p.name for p in out.iterdir())
        try:
            seal_tensors(tensors, out / "m.stenc", ring, metadata=metadata)  # type: ignore[arg-type]
        except BaseException:
            _raise_with(leftovers)
        return dict(open_tensors(out / "m.stenc", ring).tensors), leftovers
    if path == "store":
        audit = MemoryAuditRecorder()
        store = EncryptedCheckpointStore(out, ring, audit=audit)

        def store_leftovers() -> list[str]:
            return sorted(p.name for p in out.iterdir() if p.name != ".store-id")
        try:
            store.save(1, tensors, dict(metadata or {}))  # type: ignore[arg-type]
        except BaseException:
            assert [e["outcome"] for e in audit.events] == ["failure"], "a refused save is audited"
            _raise_with(store_leftovers)
        return dict(store.load().tensors), store_leftovers
    if path == "transport_v2":
        wire = _Wire()

        def wire_leftovers() -> list[str]:
            return [f"{len(c)} bytes sent" for c in wire.chunks]
        try:
            sealer2.send(wire, tensors, metadata)  # type: ignore[arg-type]
        except BaseException:
            _raise_with(wire_leftovers)
        return dict(opener.open(b"".join(wire.chunks))), wire_leftovers
    assert path == "transport_v1"
    try:
        message = sealer1.seal(tensors, metadata)  # type: ignore[arg-type]
    except BaseException:
        _raise_with(list)  # all in memory: nothing can have left
    return dict(opener.open(message)), list


def _raise_with(leftovers: Callable[[], list[str]]) -> None:
    import sys

    exc = sys.exc_info()[1]
    assert exc is not None
    exc.leftovers = leftovers()  # type: ignore[attr-defined]
    raise exc


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().resolve_conj().resolve_neg().reshape(-1).clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_exact(sent: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(sent)
    for k, t in sent.items():
        assert got[k].dtype == t.dtype, k
        assert tuple(got[k].shape) == tuple(t.shape), k
        assert raw_bytes(got[k]) == raw_bytes(t), k


def refused(path: str, tensors: Mapping[Any, Any], tmp_path: Path, ring: LocalKeyring, parties: Any,
            metadata: Mapping[Any, Any] | None = None) -> UnsupportedTensorError:
    """Sealing must raise UnsupportedTensorError and leave nothing behind; returns the error."""
    with pytest.raises(UnsupportedTensorError) as info:
        _seal_and_open(path, tensors, tmp_path, ring, parties, metadata)
    err = info.value
    assert isinstance(err, CryptoError)
    assert err.leftovers == [], f"{path} wrote something before refusing: {err.leftovers}"  # type: ignore[attr-defined]
    assert err.hint, "the error says what to do"
    return err


def sample(dtype: torch.dtype) -> torch.Tensor:
    """A (4, 8) tensor of ``dtype`` holding arbitrary bit patterns - NaN payloads, signalling NaNs,
    subnormals, -0.0 and infinities included - or, for dtypes with no byte layout, whatever torch
    can build."""
    g = torch.Generator().manual_seed(1234)
    if dtype in QUANTIZED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(torch.linspace(-1, 1, 32).reshape(4, 8), 0.1,
                                             0 if dtype == torch.qint8 else 2, dtype)
    if dtype == torch.bool:
        return torch.rand(4, 8, generator=g) > 0.5
    try:
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (4 * 8 * size,), dtype=torch.uint8, generator=g)
        t = raw.view(dtype).reshape(4, 8)
    except (RuntimeError, TypeError):
        return torch.empty(4, 8, dtype=dtype)  # sub-byte shells (int4, uint3, ...) have no byte view
    if dtype.is_floating_point and size >= 2:  # explicit specials on top of the random patterns
        specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")]).to(dtype)
        t.view(-1)[:5] = specials
    return t


# -- dtypes ----------------------------------------------------------------------------------------


def test_the_dtype_list_is_complete() -> None:
    assert set(ALL_DTYPES) >= SUPPORTED | QUANTIZED
    assert len(ALL_DTYPES) >= 40  # torch 2.13 has 46; a renamed module would make this test vacuous


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly_or_is_refused_before_writing(
        dtype: torch.dtype, path: str, tmp_path: Path, ring: LocalKeyring, parties: Any) -> None:
    tensor = sample(dtype)
    # "a" is written before "w" (name order): a refusal of "w" must still leave nothing behind.
    tensors = {"a": torch.arange(6, dtype=torch.float32), "w": tensor}
    if dtype in SUPPORTED:
        got, _ = _seal_and_open(path, tensors, tmp_path, ring, parties)
        assert_bit_exact(tensors, got)
        return
    err = refused(path, tensors, tmp_path, ring, parties)
    assert "'w'" in str(err) and str(dtype) in str(err)


@pytest.mark.parametrize(("dtype", "advice"), [
    (torch.complex128, "view_as_real"), (torch.complex32, "view_as_real"),
    (torch.float4_e2m1fn_x2, "view(torch.uint8)"), (torch.qint8, "dequantize"), (torch.quint4x2, "int_repr"),
    (torch.int4, "int8"), (torch.bits8, "view(torch.uint8)"),
], ids=str)
def test_a_refused_dtype_says_what_to_do(dtype: torch.dtype, advice: str, tmp_path: Path, ring: LocalKeyring,
                                         parties: Any) -> None:
    err = refused("seal_tensors", {"layer.weight": sample(dtype)}, tmp_path, ring, parties)
    assert "'layer.weight'" in str(err) and str(dtype) in str(err) and advice in str(err.hint)


def test_the_advice_for_complex128_restores_the_tensor_exactly(tmp_path: Path, ring: LocalKeyring) -> None:
    z = sample(torch.complex128)
    seal_tensors({"z": torch.view_as_real(z)}, tmp_path / "z.stenc", ring)
    back = torch.view_as_complex(open_tensors(tmp_path / "z.stenc", ring).tensors["z"])
    assert back.dtype == torch.complex128 and raw_bytes(back) == raw_bytes(z)


def test_supported_dtypes_are_the_safetensors_names(tmp_path: Path, ring: LocalKeyring) -> None:
    """The payload is safetensors: each supported dtype gets the name safetensors itself writes for it,
    a decrypted payload loads in ``safetensors.torch.load`` (where that version maps the name back),
    and a payload written by safetensors opens with our reader."""
    import json
    import struct

    import safetensors.torch

    from securetrain.crypto import _container as C

    for dtype in sorted(SUPPORTED, key=str):
        t = sample(dtype)
        theirs = safetensors.torch.save({"w": t})
        ours = C.encode_tensors({"w": t})
        name = json.loads(theirs[8:8 + struct.unpack("<Q", theirs[:8])[0]])["w"]["dtype"]
        assert json.loads(ours[8:8 + struct.unpack("<Q", ours[:8])[0]])["w"]["dtype"] == name, dtype
        assert_bit_exact({"w": t}, C.decode_tensors(theirs)[0])  # safetensors -> us
        try:
            loaded = safetensors.torch.load(ours)  # us -> safetensors
        except KeyError:
            assert name == "F8_E8M0", f"safetensors cannot load {name}"  # 0.8 writes F8_E8M0 but has no reverse map
            continue
        assert_bit_exact({"w": t}, loaded)


# -- views: conjugate and negative bits --------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_conjugate_and_negative_views_are_written_resolved(path: str, tmp_path: Path, ring: LocalKeyring,
                                                           parties: Any) -> None:
    z = torch.tensor([1 + 2j, -3 - 0j, complex(float("nan"), -0.0)], dtype=torch.complex64)
    tensors = {"conj": z.conj(), "neg": torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag,
               "neg_strided": z.conj().imag}
    assert tensors["conj"].is_conj() and tensors["neg"].is_neg() and tensors["neg"].is_contiguous()
    got, _ = _seal_and_open(path, tensors, tmp_path, ring, parties)
    assert_bit_exact(tensors, got)  # raw_bytes resolves the bits: the values are what was written
    assert not got["conj"].is_conj() and not got["neg"].is_neg()
    assert got["neg"].tolist() == [-2.0]


@pytest.mark.parametrize("path", PATHS)
def test_a_one_element_view_with_a_stride_is_written(path: str, tmp_path: Path, ring: LocalKeyring,
                                                     parties: Any) -> None:
    """torch calls a one-element tensor contiguous whatever its stride (``x[::4]`` of 4 elements),
    so ``.contiguous()`` keeps the stride; the byte view must not depend on it."""
    tensors = {"a": torch.arange(4.0)[::4], "b": torch.arange(8, dtype=torch.int16).reshape(2, 4)[:1, ::4]}
    assert tensors["a"].stride() == (4,) and tensors["a"].is_contiguous()
    got, _ = _seal_and_open(path, tensors, tmp_path, ring, parties)
    assert_bit_exact(tensors, got)


# -- layouts, shapes, devices, subclasses ------------------------------------------------------------


class _PlainSubclass(torch.Tensor):
    """A __torch_function__-only subclass: its memory is an ordinary tensor's."""


def _layout_cases() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "transposed": base.t(), "strided": base[:, ::2], "offset": base[2:], "row": base[1],
        "expanded": torch.tensor([1.0, -0.0]).expand(3, 2),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "scalar": torch.tensor(float("nan")), "scalar_int": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, 5), "empty_huge_dims": torch.empty(0, 2**62), "empty_0d_like": torch.empty(1, 0, 1),
        "requires_grad": torch.randn(3, requires_grad=True), "non_leaf": torch.randn(3, requires_grad=True) * 2,
        "parameter": torch.nn.Parameter(torch.randn(2, 2)), "subclass": torch.ones(3).as_subclass(_PlainSubclass),
    }


@pytest.mark.parametrize("path", PATHS)
def test_views_shapes_and_autograd_state_round_trip(path: str, tmp_path: Path, ring: LocalKeyring,
                                                   parties: Any) -> None:
    tensors = _layout_cases()
    got, _ = _seal_and_open(path, tensors, tmp_path, ring, parties)
    assert_bit_exact(tensors, got)
    assert all(type(t) is torch.Tensor and not t.requires_grad and t.is_contiguous() for t in got.values())


def _no_host_bytes(kind: str) -> tuple[torch.Tensor, str]:
    """A tensor whose bytes cannot be read on the host as a dense array, and a word its hint must contain."""
    if kind == "meta":
        return torch.empty(3, 4, device="meta"), "to_empty"
    if kind == "sparse_coo":
        return torch.eye(3).to_sparse(), "to_dense"
    if kind == "sparse_csr":
        return torch.eye(3).to_sparse_csr(), "to_dense"
    if kind == "mkldnn":
        return torch.randn(2, 3).to_mkldnn(), "to_dense"
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "unbind"
    if kind == "nested_jagged":
        return torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged), "unbind"
    if kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return torch.empty(3), "plain tensor"
    if kind == "uninitialized":
        return torch.nn.LazyLinear(3).weight, "forward"
    raise AssertionError(kind)


NO_HOST_BYTES = ("meta", "sparse_coo", "sparse_csr", "mkldnn", "nested", "nested_jagged", "fake", "uninitialized")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", NO_HOST_BYTES)
def test_tensors_without_dense_host_bytes_are_refused_before_writing(
        kind: str, path: str, tmp_path: Path, ring: LocalKeyring, parties: Any) -> None:
    tensor, advice = _no_host_bytes(kind)
    err = refused(path, {"a": torch.ones(2), "w": tensor}, tmp_path, ring, parties)
    assert "'w'" in str(err) and "torch.float32" in str(err) and advice in str(err.hint), str(err)


def test_a_dtensor_is_refused_with_the_way_to_gather_it(tmp_path: Path, ring: LocalKeyring) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        shard = distribute_tensor(torch.arange(6.0).reshape(2, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(UnsupportedTensorError, match="'w'.*DTensor") as info:
            seal_tensors({"w": shard}, tmp_path / "d.stenc", ring)
        assert "full_tensor" in str(info.value.hint) and not (tmp_path / "d.stenc").exists()
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_tensors_round_trip_through_the_host(tmp_path: Path, ring: LocalKeyring) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tensors = {k: sample(k_dtype).cuda() for k, k_dtype in
               (("c64", torch.complex64), ("bf16", torch.bfloat16), ("f8", torch.float8_e4m3fn))}
    tensors["strided"] = torch.randn(8, 8, device="cuda").t()
    seal_tensors(tensors, tmp_path / "g.stenc", ring)
    got = open_tensors(tmp_path / "g.stenc", ring, device="cuda").tensors
    assert all(t.device.type == "cuda" for t in got.values())
    assert_bit_exact(tensors, got)


# -- keys, values, metadata ----------------------------------------------------------------------------


class _DuplicateNames(Mapping[str, torch.Tensor]):
    """A Mapping whose iteration yields one name twice (a dict cannot; a custom Mapping can)."""

    def __init__(self) -> None:
        self._items = [("w", torch.ones(2)), ("a", torch.zeros(1)), ("w", torch.ones(3))]

    def __getitem__(self, key: str) -> torch.Tensor:
        return dict(self._items)[key]

    def __iter__(self) -> Any:
        return iter([k for k, _ in self._items])

    def __len__(self) -> int:
        return len(self._items)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("tensors", "expect"), [
    ({0: torch.ones(1)}, "0"),
    ({"a": torch.ones(1), 3: torch.ones(1)}, "3"),  # mixed str/int keys: sorting them raised TypeError
    ({"": torch.ones(1)}, "''"),
    ({"__metadata__": torch.ones(1)}, "'__metadata__'"),
    (_DuplicateNames(), "'w'"),
], ids=["int", "mixed", "empty", "metadata", "duplicate"])
def test_invalid_keys_are_refused_before_writing(tensors: Any, expect: str, path: str, tmp_path: Path,
                                                 ring: LocalKeyring, parties: Any) -> None:
    err = refused(path, tensors, tmp_path, ring, parties)
    assert expect in str(err)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("value", "type_name"), [
    (3, "int"), (0.5, "float"), (None, "NoneType"), ([torch.ones(1)], "list"), ({"x": torch.ones(1)}, "dict"),
    (torch.ones(2).numpy(), "ndarray"),
])
def test_non_tensor_values_are_refused_before_writing(value: Any, type_name: str, path: str, tmp_path: Path,
                                                      ring: LocalKeyring, parties: Any) -> None:
    err = refused(path, {"a": torch.ones(1), "w": value}, tmp_path, ring, parties)
    assert "'w'" in str(err) and type_name in str(err)


def test_an_optimizer_state_dict_is_refused_with_the_way_to_checkpoint_it(tmp_path: Path, ring: LocalKeyring,
                                                                           parties: Any) -> None:
    """Optimizer state holds ints, floats, tuples and nested dicts: those go to JSON metadata, never pickle.
    The refusal points at the flattening the trainer's checkpoints use (and which round-trips)."""
    from securetrain.training import state as st

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    err = refused("seal_tensors", opt.state_dict(), tmp_path, ring, parties)
    assert "flatten_optimizer" in str(err.hint)
    tensors, meta = st.flatten_optimizer(opt.state_dict())
    sealed = seal_tensors(tensors, tmp_path / "o.stenc", ring, metadata={"optim": st.dumps(meta)})
    opened = open_tensors(sealed.path, ring)
    back = st.unflatten_optimizer(opened.tensors, st.loads(opened.metadata["optim"]))
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), amsgrad=True)
    fresh.load_state_dict(back)
    for pid, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(fresh.state_dict()["state"][pid][key], value), key
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize("path", ["transport_v2", "transport_v1"])
@pytest.mark.parametrize("metadata", [{"round": 3}, {1: "x"}, {"x": None}], ids=["int-value", "int-key", "none"])
def test_non_string_transport_metadata_is_refused_before_sending(metadata: dict[Any, Any], path: str,
                                                                 tmp_path: Path, ring: LocalKeyring,
                                                                 parties: Any) -> None:
    """It used to be sent, and the receiver then refused the authentic message as malformed."""
    refused(path, {"a": torch.ones(1)}, tmp_path, ring, parties, metadata=metadata)


def test_prefect_results_use_the_same_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    monkeypatch.setenv("SECURETRAIN_KEK", bytes(range(32)).hex())
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    ser = EncryptedTensorSerializer()
    z = sample(torch.complex64)
    back = ser.loads(ser.dumps({"z": z, "n": 3}))
    assert back["n"] == 3 and raw_bytes(back["z"]) == raw_bytes(z) and back["z"].dtype == torch.complex64
    with pytest.raises(UnsupportedTensorError, match="complex128"):
        ser.dumps({"z": sample(torch.complex128)})
    with pytest.raises(UnsupportedTensorError, match="without pickle"):
        ser.dumps({"obj": object()})
    with pytest.raises(UnsupportedTensorError, match="keys must be strings"):
        ser.dumps({1: torch.ones(1)})


# -- shared storage: tied weights, views of one another ------------------------------------------------


class TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one Parameter (weight tying, as in GPT-2 or T5)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8)
        self.body = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.embed.weight


def _payload(path: Path, ring: LocalKeyring, tmp_path: Path) -> Path:
    """The decrypted safetensors payload of a sealed file."""
    from securetrain.crypto import decrypt_file

    out = tmp_path / f"{path.stem}.safetensors"
    decrypt_file(path, out, ring)
    return out


@pytest.mark.parametrize("path", PATHS)
def test_tied_weights_are_written_once_and_come_back_tied(path: str, tmp_path: Path, ring: LocalKeyring,
                                                          parties: Any) -> None:
    model = TiedLM()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # two names, one memory
    got, _ = _seal_and_open(path, state, tmp_path, ring, parties)
    assert_bit_exact(state, got)
    assert got["lm_head.weight"] is got["embed.weight"], "the tie is restored, not two copies"
    assert list(got) == sorted(state), "opened in name order, aliases included"
    fresh = TiedLM()
    torch.nn.init.zeros_(fresh.embed.weight)
    fresh.load_state_dict(got)  # strict: every key of the model is there
    assert fresh.lm_head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)


def test_a_tied_checkpoint_is_what_safetensors_save_model_writes(tmp_path: Path, ring: LocalKeyring) -> None:
    """Same mechanism as safetensors: the shared tensor is stored once, under the name
    ``safetensors.torch.save_model`` keeps, so the decrypted payload loads with ``load_model``."""
    import safetensors.torch

    model = TiedLM()
    sealed = seal_tensors(model.state_dict(), tmp_path / "lm.stenc", ring)
    payload = _payload(sealed.path, ring, tmp_path)
    safetensors.torch.save_model(model, str(tmp_path / "reference.safetensors"))
    ours, theirs = (safetensors.torch.load_file(p) for p in (payload, tmp_path / "reference.safetensors"))
    assert set(ours) == set(theirs) == {"body.bias", "body.weight", "embed.weight"}
    fresh = TiedLM()
    torch.nn.init.zeros_(fresh.embed.weight)
    safetensors.torch.load_model(fresh, str(payload))
    assert fresh.lm_head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    one_copy = model.embed.weight.numel() * 4
    assert sealed.size < 2 * one_copy, "the tied matrix is stored once"


@pytest.mark.parametrize("path", PATHS)
def test_views_sharing_storage_round_trip_as_what_they_show(path: str, tmp_path: Path, ring: LocalKeyring,
                                                            parties: Any) -> None:
    """Only identical views (same memory, dtype, shape, strides) are one tensor; anything else that
    overlaps is written as its own copy - its values exact, its aliasing not kept."""
    big = torch.arange(10.0)
    tensors = {"all": big, "part": big[2:5], "part_again": big[2:5], "reshaped": big.view(2, 5),
               "as_int": big.view(torch.int32), "lo": big[:5], "hi": big[5:], "strided": big[::3]}
    got, _ = _seal_and_open(path, tensors, tmp_path, ring, parties)
    assert_bit_exact(tensors, got)
    assert got["part_again"] is got["part"]
    distinct = [got[k] for k in ("all", "part", "reshaped", "as_int", "lo", "hi", "strided")]
    assert len({t.untyped_storage().data_ptr() for t in distinct}) == len(distinct)


def test_prefect_results_keep_shared_tensors_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    from securetrain.crypto.prefect_serializer import EncryptedTensorSerializer

    monkeypatch.setenv("SECURETRAIN_KEK", bytes(range(32)).hex())
    monkeypatch.delenv("SECURETRAIN_KEYRING", raising=False)
    ser = EncryptedTensorSerializer()
    w = torch.randn(4, 4)
    back = ser.loads(ser.dumps({"a": w, "b": [w, w.t()]}))
    assert back["a"] is back["b"][0] and torch.equal(back["b"][1], w.t())


@pytest.mark.parametrize("path", ["seal_tensors", "transport_v2", "transport_v1"])
def test_the_alias_metadata_key_is_reserved(path: str, tmp_path: Path, ring: LocalKeyring, parties: Any) -> None:
    from securetrain.crypto import _container as C

    refused(path, {"a": torch.ones(1)}, tmp_path, ring, parties, metadata={C.ALIASES_KEY: "{}"})


def test_the_store_drops_a_stale_alias_key_and_hides_its_own(tmp_path: Path, ring: LocalKeyring) -> None:
    from securetrain.crypto import _container as C

    store = EncryptedCheckpointStore(tmp_path, ring)
    store.save(1, TiedLM().state_dict(), {C.ALIASES_KEY: '{"x": "y"}', "epoch": "2"})
    loaded = store.load()
    assert C.ALIASES_KEY not in loaded.metadata and loaded.metadata["epoch"] == "2"
    assert loaded.tensors["lm_head.weight"] is loaded.tensors["embed.weight"]


@pytest.mark.parametrize("aliases", [
    '{"b": "missing"}', '{"a": "a"}', '{"b": "c", "c": "a"}', '["b", "a"]', '{"b": 1}', "not json",
    '{"__metadata__": "a"}', '{"": "a"}',
], ids=["missing", "self", "chain", "list", "int", "garbage", "reserved", "empty"])
def test_a_malformed_alias_map_is_refused_by_every_reader(aliases: str, tmp_path: Path, ring: LocalKeyring) -> None:
    """Written by a key holder (or a bug): refused as UnsafePayloadError, never a KeyError or a
    silently missing tensor."""
    import safetensors.torch

    from securetrain.crypto import _container as C
    from securetrain.crypto import encrypt_bytes
    from securetrain.crypto.checkpoint import read_checkpoint
    from securetrain.crypto.errors import UnsafePayloadError

    payload = safetensors.torch.save({"a": torch.ones(2), "c": torch.zeros(1)}, metadata={C.ALIASES_KEY: aliases})
    with pytest.raises(UnsafePayloadError, match="alias"):
        C.decode_tensors(payload)
    import io

    with pytest.raises(UnsafePayloadError, match="alias"):
        read_checkpoint(io.BytesIO(encrypt_bytes(payload, ring)), ring)


# -- the reader: one interpretation of a header, typed errors only ---------------------------------------


def _payload_with_header(header: str, data: bytes) -> bytes:
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    import struct

    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(("header", "data"), [
    ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}',
     b"\0" * 4),  # a duplicate name: which "a" is it? json.loads silently kept the last one
    ('{"a":{"dtype":"U8","shape":"12","data_offsets":[0,2]}}', b"\0" * 2),  # a string shape read as [1, 2]
    ('{"a":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}}', b"\0" * 2),
    ('{"a":{"dtype":"U8","shape":[true,2],"data_offsets":[0,2]}}', b"\0" * 2),
    ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0.0,2]}}', b"\0" * 2),
    ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}}', b"\0" * 2),
    ('{"a":{"dtype":"F32","shape":[0,18446744073709551616],"data_offsets":[0,0]}}', b""),  # torch: TypeError
    ('{"a":{"dtype":"F32","shape":[1099511627776,1099511627776,0],"data_offsets":[0,0]}}', b""),  # RuntimeError
    ('{"a":{"dtype":"C128","shape":[1],"data_offsets":[0,16]}}', b"\0" * 16),
    ('{"a":["F32",[1],[0,4]]}', b"\0" * 4),
    ('{"__metadata__":{"k":"v"},"__metadata__":{"k":"w"}}', b""),
], ids=["duplicate-name", "string-shape", "float-dim", "bool-dim", "float-offset", "three-offsets",
        "dim-over-int64", "storage-overflow", "unknown-dtype", "entry-not-object", "duplicate-metadata"])
def test_malformed_headers_are_refused_as_unsafe_payloads(header: str, data: bytes, ring: LocalKeyring) -> None:
    import io

    from securetrain.crypto import _container as C
    from securetrain.crypto import encrypt_bytes
    from securetrain.crypto.checkpoint import read_checkpoint
    from securetrain.crypto.errors import UnsafePayloadError

    payload = _payload_with_header(header, data)
    with pytest.raises(UnsafePayloadError):
        C.decode_tensors(payload)
    with pytest.raises(UnsafePayloadError):
        read_checkpoint(io.BytesIO(encrypt_bytes(payload, ring)), ring)


# -- atomic writes: a failure mid-write leaves nothing -----------------------------------------------------


@pytest.mark.parametrize("o_tmpfile", [True, False], ids=["O_TMPFILE", "named-temp"])
@pytest.mark.parametrize("failure", [RuntimeError("disk on fire"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failure_mid_write_leaves_no_partial_file(failure: BaseException, o_tmpfile: bool, tmp_path: Path,
                                                    ring: LocalKeyring, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header and the first tensor are out when the third write fails: the new file must not
    appear, an existing one must stay as it was, and no temp may stay behind."""
    from securetrain.crypto import private_file
    from securetrain.crypto._container.writer import EncryptingWriter

    monkeypatch.setattr(private_file, "USE_O_TMPFILE", o_tmpfile)
    tensors = {f"t{i}": torch.full((1 << 16,), float(i)) for i in range(4)}
    real_write = EncryptingWriter.write
    calls = {"n": 0}

    def failing_write(self: EncryptingWriter, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise failure
        return real_write(self, data)

    seal_tensors({"old": torch.zeros(3)}, tmp_path / "old.stenc", ring)
    store = EncryptedCheckpointStore(tmp_path / "store", ring)
    store.save(1, {"old": torch.zeros(3)}, {})
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.setattr(EncryptingWriter, "write", failing_write)
    for attempt in (lambda: seal_tensors(tensors, tmp_path / "new.stenc", ring),
                    lambda: seal_tensors(tensors, tmp_path / "old.stenc", ring),
                    lambda: store.save(2, tensors, {})):
        calls["n"] = 0
        with pytest.raises(type(failure)):
            attempt()
        assert calls["n"] == 3, "the failure happened mid-write"
    monkeypatch.setattr(EncryptingWriter, "write", real_write)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert list(open_tensors(tmp_path / "old.stenc", ring).tensors) == ["old"]
    assert [i.step for i in store.list()] == [1] and list(store.load().tensors) == ["old"]

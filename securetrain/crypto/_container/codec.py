"""The safetensors byte layout, written and parsed without pickle and without the blob in memory twice.

Layout: ``u64 little-endian N`` | ``N bytes of JSON`` (padded with spaces to a multiple of 8) |
raw little-endian tensor bytes. JSON maps each name to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the data region) plus an optional ``"__metadata__": {str: str}``. We write
tensors in name order; the parser accepts any order but demands contiguous, non-overlapping
offsets that cover the data region exactly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from securetrain.crypto.errors import UnsafePayloadError, UnsupportedTensorError
from securetrain.io.tied import ALIASES_KEY, aliases_json, shared_aliases
from securetrain.io.tied import restore_aliases as _restore_aliases

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)  # newer float8 variants are missing from older torch builds


# Every dtype that round-trips bit-exactly, under the name safetensors itself writes for it
# (``safetensors.torch.save``). Anything else is refused before a byte is written.
DTYPES: dict[torch.dtype, str] = {dt: code for dt, code in (
    (torch.float64, "F64"), (torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16"),
    (torch.int64, "I64"), (torch.int32, "I32"), (torch.int16, "I16"), (torch.int8, "I8"),
    (torch.uint64, "U64"), (torch.uint32, "U32"), (torch.uint16, "U16"), (torch.uint8, "U8"), (torch.bool, "BOOL"),
    (_dtype("float8_e4m3fn"), "F8_E4M3"), (_dtype("float8_e5m2"), "F8_E5M2"),
    (_dtype("float8_e4m3fnuz"), "F8_E4M3FNUZ"), (_dtype("float8_e5m2fnuz"), "F8_E5M2FNUZ"),
    (_dtype("float8_e8m0fnu"), "F8_E8M0"),
    (torch.complex64, "C64"),
) if dt is not None}
FROM_DTYPE = {v: k for k, v in DTYPES.items()}

_QUANTIZED = {_dtype(n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")} - {None}
_BITS = {_dtype(n) for n in ("bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")} - {None}
_ADVICE: dict[torch.dtype | None, str] = {
    torch.complex128: "safetensors has no complex128: seal torch.view_as_real(t) (float64, last dimension 2) "
                      "and restore it with torch.view_as_complex(...) after opening",
    torch.complex32: "safetensors has no complex32: seal torch.view_as_real(t) (float16, last dimension 2) "
                     "and restore it with torch.view_as_complex(...) after opening",
    _dtype("float4_e2m1fn_x2"): "seal t.view(torch.uint8) (the same packed bytes) and restore it with "
                                ".view(torch.float4_e2m1fn_x2) after opening",
}


def unsupported_dtype(name: str, dtype: torch.dtype) -> UnsupportedTensorError:
    """The error for tensor ``name`` whose ``dtype`` has no safetensors layout, saying what to do instead."""
    if dtype in _ADVICE:
        hint = _ADVICE[dtype]
    elif dtype in _QUANTIZED:
        hint = ("seal t.dequantize() (float32), or t.int_repr() plus its quantization parameters "
                "(t.q_scale()/t.q_zero_point(), or q_per_channel_scales()/..._zero_points()/..._axis())")
    elif dtype in _BITS:
        hint = f"seal t.view(torch.uint8) (the raw bytes) and restore it with .view({dtype}) after opening"
    else:  # int1..int7, uint1..uint7: shells without storage
        target = "torch.uint8" if str(dtype).startswith("torch.uint") else "torch.int8"
        hint = f"sub-byte integers have no byte layout in safetensors: convert with t.to({target})"
    return UnsupportedTensorError(f"tensor {name!r} has dtype {dtype}, which a sealed safetensors payload cannot hold",
                                  hint=hint)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (an empty view for an empty tensor)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # one element with any stride counts as contiguous (x[::4] of 4 elements)
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8).numpy().data.cast("B")


@dataclass(frozen=True)
class PreparedTensors:
    """Validated tensors ready to write: ``items`` (name, detached tensor) in name order, each one a
    tensor whose bytes are written; ``aliases`` maps every other name to the item it is identical to."""

    items: list[tuple[str, torch.Tensor]]
    aliases: dict[str, str]


def prepare_tensors(tensors: Mapping[str, torch.Tensor]) -> PreparedTensors:
    """Validate every name and tensor; what to write, in name order, with tied tensors written once.

    Everything that could fail while writing is checked here, before the first byte goes out:
    a refused entry raises :class:`UnsupportedTensorError` naming it and saying what to do.
    """
    names = list(tensors)
    for name in names:
        check_name(name)
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UnsupportedTensorError(f"tensor name {dup!r} appears more than once in the mapping",
                                     hint="pass a dict (one value per name)")
    if {"state", "param_groups"} <= set(names) and not isinstance(tensors["param_groups"], torch.Tensor):
        raise UnsupportedTensorError(
            f"this is an optimizer state dict ('param_groups' is a {type(tensors['param_groups']).__name__}), "
            "not a mapping of names to tensors",
            hint="flatten it with securetrain.training.state.flatten_optimizer: seal the tensors it returns and "
                 "put the rest, st.dumps(meta), in the metadata (the trainer's checkpoints do this)")
    checked = {name: check_tensor(name, tensors[name]) for name in sorted(names)}
    aliases = shared_aliases(checked)
    return PreparedTensors([(n, t.detach()) for n, t in checked.items() if n not in aliases], aliases)


def restore_aliases(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict[str, torch.Tensor],
                                                                                      dict[str, str]]:
    """The reader's side of :func:`shared_aliases` (:func:`securetrain.io.tied.restore_aliases`); a
    malformed alias map is :class:`UnsafePayloadError`."""
    try:
        return _restore_aliases(tensors, meta)
    except ValueError as exc:
        raise UnsafePayloadError(str(exc)) from None


def check_name(name: object) -> None:
    if not isinstance(name, str):
        raise UnsupportedTensorError(f"tensor name {name!r} is a {type(name).__name__}, not a string",
                                     hint="safetensors names are strings: use str(key), e.g. f'{key}'")
    if not name or name == "__metadata__":
        raise UnsupportedTensorError(f"invalid tensor name {name!r}",
                                     hint="use a non-empty name other than '__metadata__'")


def check_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` if its bytes can be written as a dense host array that reads back bit-exactly."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(f"{name!r} is a {type(t).__name__}, not a tensor",
                                     hint="seal tensors only: convert the value with torch.as_tensor(...), or put "
                                          "it in the str -> str metadata (e.g. as JSON)")
    if is_lazy(t):
        raise UnsupportedTensorError(f"tensor {name!r} (dtype {t.dtype}) is an uninitialized lazy parameter "
                                     "(no shape, no data)",
                                     hint="run one forward pass to initialize the lazy module, then seal its state")
    if t.is_nested:
        raise UnsupportedTensorError(f"tensor {name!r} is a nested tensor (dtype {t.dtype}); safetensors holds "
                                     "dense tensors only", hint="seal its components: dict(enumerate(t.unbind())) "
                                     "with string keys, or t.to_padded_tensor(0.0) and the lengths")
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:  # type: ignore[comparison-overlap]
        kind = type(t).__name__
        how = ("gather it with t.full_tensor(), or use get_model_state_dict(..., full_state_dict=True)"
               if kind == "DTensor" else "convert it to a plain tensor that holds its values")
        raise UnsupportedTensorError(f"tensor {name!r} is a {kind} (a tensor subclass whose memory is not its "
                                     f"values), dtype {t.dtype}", hint=how)
    if t.layout != torch.strided:
        raise UnsupportedTensorError(f"tensor {name!r} has layout {t.layout} (dtype {t.dtype}); safetensors holds "
                                     "dense tensors only", hint="seal t.to_dense() (or its index and value tensors)")
    if t.device.type == "meta":
        raise UnsupportedTensorError(f"tensor {name!r} (dtype {t.dtype}) is on the meta device and has no data",
                                     hint="materialize it first, e.g. module.to_empty(device='cpu') and load or "
                                          "initialize the weights")
    if t.dtype not in DTYPES:
        raise unsupported_dtype(name, t.dtype)
    return t


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` as a plain dict, if it maps strings to strings (safetensors' ``__metadata__``)."""
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise UnsupportedTensorError(f"metadata entry {k!r}: {type(v).__name__} is not str -> str",
                                         hint="metadata is str -> str: pass str(value), or JSON for structures")
    if ALIASES_KEY in metadata:
        raise UnsupportedTensorError(f"metadata key {ALIASES_KEY!r} is reserved (it records tied tensors)",
                                     hint="drop it: the readers set and remove it themselves")
    return dict(metadata)


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in contiguous layout with its values materialized (a no-op for a tensor that
    already is): a conjugate or negative view (``z.conj()``, ``z.conj().imag``) is resolved, since
    its memory holds the values before the lazy conjugation/negation."""
    return t.to("cpu").resolve_conj().resolve_neg().contiguous()


def build_header(prepared: PreparedTensors, meta: Mapping[str, str]) -> tuple[bytes, int]:
    """The padded JSON header for ``prepared`` and the size of the data region."""
    metadata = check_metadata(meta)
    if prepared.aliases:
        metadata[ALIASES_KEY] = aliases_json(prepared.aliases)
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in prepared.items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    return hjson, offset


def encode_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize to safetensors bytes (loadable by ``safetensors.torch.load``)."""
    prepared = prepare_tensors(tensors)
    hjson, size = build_header(prepared, metadata or {})
    out = bytearray(8 + len(hjson) + size)
    out[:8] = struct.pack("<Q", len(hjson))
    out[8:8 + len(hjson)] = hjson
    pos = 8 + len(hjson)
    for _, t in prepared.items:
        view = byte_view(cpu_contiguous(t))
        out[pos:pos + len(view)] = view
        pos += len(view)
    return bytes(out)


def decode_tensors(data: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes strictly into fresh tensors (copies; never aliases ``data``)."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise UnsafePayloadError("payload is too short to be safetensors")
    first8 = bytes(view[:8])
    hlen = split_header(first8, len(view))
    raw = bytes(view[8:8 + hlen])
    if raw[:1] != b"{":
        raise refuse(first8, "header is not a JSON object")
    entries, meta = parse_header(raw, len(view) - 8 - hlen)
    pos = 8 + hlen
    tensors = {}
    for name, dtype, shape, nbytes in entries:
        t = torch.empty(shape, dtype=dtype)
        if nbytes:
            byte_view(t)[:] = view[pos:pos + nbytes]
        pos += nbytes
        tensors[name] = t
    return restore_aliases(tensors, meta)


def refuse(first8: bytes, reason: str) -> UnsafePayloadError:
    """The error for a payload that is not safetensors, naming pickle/torch.save when it looks like one.

    Only called once safetensors parsing failed: a valid safetensors header length can itself
    start with the bytes of a pickle protocol marker (e.g. 640 = 80 02 00..), so magic sniffing
    alone must never reject a payload.
    """
    if first8[:1] == b"\x80" and 2 <= first8[1] <= 5 or first8[:4] == b"PK\x03\x04" or first8[:1] in (b"(", b"}"):
        return UnsafePayloadError("payload is a pickle / torch.save archive; refusing to load it",
                                  hint="only safetensors payloads are accepted (unpickling can execute code)")
    return UnsafePayloadError(f"payload is not a safetensors layout: {reason}")


def split_header(first8: bytes, total: int) -> int:
    """Validate the u64 header length against the payload size; return it."""
    (hlen,) = struct.unpack("<Q", first8)
    if hlen < 2 or hlen > min(MAX_HEADER_BYTES, total - 8):
        raise refuse(first8, f"header length {hlen} for a {total}-byte payload")
    return hlen


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if any(k == other for other, _ in pairs[:i]))
        raise UnsafePayloadError(f"safetensors header names {dup!r} twice")
    return doc


def _is_int(value: object) -> bool:
    return type(value) is int  # not bool, not float: JSON 2.0 or true is no size


_MAX_INT64 = 2**63 - 1


def parse_header(raw: bytes, data_len: int) -> tuple[list[tuple[str, torch.dtype, list[int], int]], dict[str, str]]:
    """Parse and validate a safetensors JSON header strictly, so that it has exactly one reading.

    Refused (``UnsafePayloadError``): a name given twice (JSON parsers differ on which one wins),
    shapes and offsets that are not lists of JSON integers (a string shape ``"12"`` is not
    ``[1, 2]``), dimensions torch cannot allocate (over int64, or whose product overflows), unknown
    dtypes, and offsets that do not tile the data region exactly.
    """
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UnsafePayloadError("payload header is not safetensors JSON") from None
    if not isinstance(doc, dict):
        raise UnsafePayloadError("safetensors header must be a JSON object")
    meta = doc.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise UnsafePayloadError("safetensors __metadata__ must map strings to strings")
    entries = []
    for name, spec in doc.items():
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
            raise UnsafePayloadError(f"malformed safetensors entry {name!r}")
        shape, offsets = spec["shape"], spec["data_offsets"]
        if not (isinstance(shape, list) and all(_is_int(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
            raise UnsafePayloadError(f"malformed safetensors entry {name!r}: shape and data_offsets must be "
                                     "lists of integers")
        dtype = FROM_DTYPE.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise UnsafePayloadError(f"tensor {name!r} has dtype {spec['dtype']!r}, which this reader does not know")
        if any(d < 0 for d in shape):
            raise UnsafePayloadError(f"negative dimension in {name!r}")
        numel = nonzero = 1
        for d in shape:
            numel *= d
            nonzero *= d or 1
        if nonzero > _MAX_INT64:
            raise UnsafePayloadError(f"tensor {name!r}: shape {shape} overflows a 64-bit size")
        begin, end = offsets
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes:
            raise UnsafePayloadError(f"tensor {name!r}: offsets span {end - begin} bytes, shape needs {nbytes}")
        entries.append((begin, name, dtype, shape, nbytes))
    entries.sort(key=lambda e: (e[0], e[4]))
    pos = 0
    for begin, name, *_rest, nbytes in entries:
        if begin != pos:
            raise UnsafePayloadError(f"tensor {name!r} does not start where the previous one ended")
        pos += nbytes
    if pos != data_len:
        raise UnsafePayloadError(f"tensors cover {pos} bytes but the payload has {data_len}")
    return [(n, d, s, b) for _, n, d, s, b in entries], meta

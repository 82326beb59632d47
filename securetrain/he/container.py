"""The small framed container around TenSEAL's protobuf bytes (contexts, ciphertexts).

Layout (all integers big-endian)::

    magic        8 bytes   b"STHE\\x00\\x01\\r\\n"   ("STHE", container version 1, CR LF catches
                                                   text-mode mangling)
    header_len   u32       length of the header, 1 .. 1 MiB
    header       JSON, UTF-8, RFC 8785 canonical form (sorted keys, no whitespace)
    frames       header["frames"] entries, in order: u64 length, then that many bytes

The header always has ``kind`` (str) and ``frames`` (list of {"length": int, "sha256": hex}).
Readers reject: wrong magic, oversized/invalid header, a frame whose length or SHA-256 differs
from the header (corruption, truncation, splicing), and trailing bytes. The digests detect
accidents and tampering *in transit between honest parties*; they are not a signature — anyone
can rewrite a file and its header. Authenticity comes from the audit log / transport.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from securetrain.he.errors import HEFormatError

MAGIC = b"STHE\x00\x01\r\n"
MAX_HEADER = 1 << 20
MAX_FRAMES = 1 << 20


@dataclass(frozen=True)
class Container:
    header: dict[str, Any]
    frames: tuple[bytes, ...]

    @property
    def kind(self) -> str:
        return str(self.header["kind"])


def encode(kind: str, fields: dict[str, Any], frames: Sequence[bytes]) -> bytes:
    import rfc8785

    header = dict(fields)
    header["kind"] = kind
    header["frames"] = [{"length": len(f), "sha256": hashlib.sha256(f).hexdigest()} for f in frames]
    hb = rfc8785.dumps(header)
    if len(hb) > MAX_HEADER:
        raise HEFormatError("container header too large")
    parts = [MAGIC, struct.pack(">I", len(hb)), hb]
    for f in frames:
        parts.append(struct.pack(">Q", len(f)))
        parts.append(f)
    return b"".join(parts)


def decode(data: bytes, *, expect_kind: str | None = None, source: str = "input") -> Container:
    view = memoryview(data)
    if len(view) < len(MAGIC) + 4 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise HEFormatError(f"{source} is not a securetrain HE file (bad magic)",
                            hint="pass a file written by `securetrain he keygen/encrypt/evaluate`")
    pos = len(MAGIC)
    (hlen,) = struct.unpack_from(">I", view, pos)
    pos += 4
    if not 0 < hlen <= MAX_HEADER or pos + hlen > len(view):
        raise HEFormatError(f"{source}: header length {hlen} is invalid or the file is truncated")
    try:
        header = json.loads(bytes(view[pos : pos + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HEFormatError(f"{source}: header is not valid JSON ({exc.__class__.__name__})") from exc
    pos += hlen
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise HEFormatError(f"{source}: header has no 'kind'")
    if expect_kind is not None and header["kind"] != expect_kind:
        raise HEFormatError(f"{source} holds a {header['kind']!r}, expected a {expect_kind!r}")
    specs = header.get("frames")
    if not isinstance(specs, list) or len(specs) > MAX_FRAMES:
        raise HEFormatError(f"{source}: header 'frames' is missing or invalid")
    frames: list[bytes] = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("length"), int) or not isinstance(spec.get("sha256"), str):
            raise HEFormatError(f"{source}: frame {i} descriptor is invalid")
        if pos + 8 > len(view):
            raise HEFormatError(f"{source} is truncated (frame {i} of {len(specs)} missing)")
        (flen,) = struct.unpack_from(">Q", view, pos)
        pos += 8
        if flen != spec["length"] or pos + flen > len(view):
            raise HEFormatError(f"{source} is truncated or corrupted at frame {i}")
        frame = bytes(view[pos : pos + flen])
        pos += flen
        if hashlib.sha256(frame).hexdigest() != spec["sha256"]:
            raise HEFormatError(f"{source}: frame {i} failed its SHA-256 check (corrupted or tampered)")
        frames.append(frame)
    if pos != len(view):
        raise HEFormatError(f"{source} has {len(view) - pos} unexpected trailing bytes")
    return Container(header, tuple(frames))


def read_file(path: str | os.PathLike[str], *, expect_kind: str | None = None) -> tuple[Container, bytes]:
    """Return the decoded container and the raw bytes (whose SHA-256 the audit log records)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise HEFormatError(f"file not found: {p}") from exc
    except IsADirectoryError as exc:
        raise HEFormatError(f"expected a file, got a directory: {p}") from exc
    return decode(data, expect_kind=expect_kind, source=str(p)), data

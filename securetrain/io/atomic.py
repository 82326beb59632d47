"""Crash-safe file replacement.

Write to a temporary file in the destination's directory, fsync it, rename it over the target
(atomic on POSIX), then fsync the directory so the rename itself survives a power loss. A crash at
any point leaves either the old file or the new one, never a torn mix.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: Path) -> None:
    """Make a rename or link in ``directory`` durable (POSIX: the entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: int = 0o600) -> Iterator[BinaryIO]:
    """Yield a binary file; on clean exit it atomically replaces ``path``.

    On an exception the temporary file is removed and ``path`` is untouched. New files get
    ``mode`` (owner-only by default: most of what we write is sensitive).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Atomically replace ``path`` with ``data``."""
    with atomic_writer(path, mode=mode) as handle:
        handle.write(data)

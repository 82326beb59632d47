"""Publishing checkpoints somewhere the database's owner cannot rewrite.

Anyone holding an earlier checkpoint detects a truncated or rebuilt log, so checkpoints should
leave the database: to an append-only file (e.g. on WORM storage or a separate host) or an object
store. Anchors never overwrite: a second checkpoint for the same size is refused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from securetrain.audit.errors import AnchorError
from securetrain.audit.note import Checkpoint, split_notes


@runtime_checkable
class Anchor(Protocol):
    def publish(self, checkpoint: Checkpoint) -> str:
        """Store the checkpoint note; return where it went."""
        ...

    def notes(self) -> list[str]:
        """All notes published so far, oldest first."""
        ...


class FileAnchor:
    """Appends notes to one file with O_APPEND and fsync; readable by ``split_notes``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def publish(self, checkpoint: Checkpoint) -> str:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = checkpoint.note.encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                # One write() of a small buffer on O_APPEND lands atomically at the end.
                if os.write(fd, data) != len(data):
                    raise AnchorError(f"short write to anchor file {self.path}")
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise AnchorError(f"cannot append checkpoint to {self.path}: {exc.strerror}") from None
        return str(self.path)

    def notes(self) -> list[str]:
        if not self.path.exists():
            return []
        return split_notes(self.path.read_text(encoding="utf-8"))


class FsspecAnchor:
    """One object per checkpoint under an fsspec URL (``file://``, ``memory://``, ``s3://`` ...)."""

    def __init__(self, url: str, **storage_options: object) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self._fs, self._root = fsspec.core.url_to_fs(self.url, **storage_options)

    def _name(self, cp: Checkpoint) -> str:
        return f"{self._root}/{cp.tree_size:020d}-{hashlib.sha256(cp.root_hash).hexdigest()[:16]}.note"

    def publish(self, checkpoint: Checkpoint) -> str:
        name = self._name(checkpoint)
        try:
            self._fs.makedirs(self._root, exist_ok=True)
            if self._fs.exists(name):
                raise AnchorError(f"anchor object {name} already exists; refusing to overwrite")
            with self._fs.open(name, "wb") as handle:
                handle.write(checkpoint.note.encode())
        except AnchorError:
            raise
        except Exception as exc:  # fsspec backends raise many types
            raise AnchorError(f"cannot publish checkpoint to {self.url}: {type(exc).__name__}") from None
        return name

    def notes(self) -> list[str]:
        if not self._fs.exists(self._root):
            return []
        names = sorted(n for n in self._fs.ls(self._root, detail=False) if str(n).endswith(".note"))
        return [self._fs.cat_file(n).decode() for n in names]

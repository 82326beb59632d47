"""Atomic output files with one fsync per file and one per directory per batch.

``atomic_write_bytes`` fsyncs the file *and* its directory for every file: two fsyncs per output,
which dominates writing thousands of small DICOM files. :class:`BatchWriter` keeps the same
guarantee for every file -- a target path holds either nothing or the complete new content, never a
torn file -- by writing each file to a temporary name in its directory, fsyncing the data, then
(at :meth:`flush`) renaming the whole batch and fsyncing each touched directory once. A crash
before ``flush`` leaves no target file of that batch (only ``.*.tmp`` files, removed by
:meth:`abort` on an exception); a report must call a file "written" only after ``flush``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from types import TracebackType


class BatchWriter:
    def __init__(self, *, max_pending: int = 64, mode: int = 0o600) -> None:
        self.max_pending = max_pending
        self.mode = mode
        self._pending: dict[Path, Path] = {}  # staged temporary file -> target, in staging order
        self.last_sha256: str | None = None  # of the data staged last (the caller's own output)

    def write(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Stage ``data`` for ``path``; visible at the next :meth:`flush` (automatic every ``max_pending``).
        Staging one path twice in a batch keeps the last data (one temporary file per path and process)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        # Registered before the file exists: an exception or Ctrl-C at any point leaves it known to
        # abort(), never a stray temporary file (the window between close and registering was one).
        self._pending[tmp] = target
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self.mode)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # data durable before the rename can make it visible
            finally:
                os.close(fd)
        except BaseException:
            self._pending.pop(tmp, None)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        self.last_sha256 = hashlib.sha256(data).hexdigest()
        if len(self._pending) >= self.max_pending:
            self.flush()

    def flush(self) -> list[Path]:
        """Rename every staged file into place, then fsync each directory once. Returns the targets."""
        done: list[Path] = []
        dirs: set[Path] = set()
        for tmp, target in self._pending.items():
            os.replace(tmp, target)
            done.append(target)
            dirs.add(target.parent)
        self._pending.clear()
        for directory in dirs:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return done

    def abort(self) -> None:
        for tmp in self._pending:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._pending.clear()

    def __enter__(self) -> BatchWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.flush()
        else:
            self.abort()

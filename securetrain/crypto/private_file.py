"""Write a file so that a killed writer leaves nothing behind: ``O_TMPFILE`` + ``linkat``.

:func:`private_writer` is the crash-safe writer for plaintext (``checkpoint decrypt``) and for
containers (the checkpoint store). Where the filesystem supports it (Linux ``O_TMPFILE``: ext4,
xfs, btrfs, tmpfs, ...) the data goes into an *anonymous* inode in the destination directory,
mode 0600; it gets a name only after it was completely written and fsync'd, by ``linkat``
(``AT_EMPTY_PATH``, else ``/proc/self/fd``). A writer killed at any point - SIGKILL included -
leaves no file: the kernel frees the inode with the last descriptor.

Elsewhere the writer uses a named 0600 temp ``.<name>.<host>-<pid>.<random>.tmp`` that is removed
on every exception path and, while it exists, on SIGTERM/SIGHUP/SIGQUIT whose action is the
default (a handler installed by the application, e.g. the trainer's graceful SIGTERM, is left in
charge). Only SIGKILL (or power loss) can leave such a temp; :func:`sweep_stale_temps` removes it
once its writer is dead (same host, pid gone) or it is older than ``max_age_s``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

from securetrain.io.atomic import fsync_dir

USE_O_TMPFILE = True  # tests switch this off to exercise the named-temp path
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[0-9a-f]{16}\.tmp$")
_LEGACY_TEMP_RE = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")  # tempfile.mkstemp names (atomic_writer)
_no_tmpfile_devices: set[int] = set()
_tmpfile_devices: set[int] = set()
_live_temps: set[str] = set()
_handlers_lock = threading.Lock()


def host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{host_tag()}-{os.getpid()}.{secrets.token_hex(8)}.tmp")


def _open_anonymous(directory: Path, mode: int, name: str = "probe") -> int | None:
    if not USE_O_TMPFILE or not hasattr(os, "O_TMPFILE"):
        return None
    flags = os.O_TMPFILE | os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    try:
        dev = os.stat(directory).st_dev
        if dev in _no_tmpfile_devices:
            return None
        if dev not in _tmpfile_devices:
            # Probe once per filesystem, on a throwaway inode (a linked-then-unlinked O_TMPFILE
            # inode cannot be linked again), that an anonymous inode can be given a name.
            probe_fd = os.open(directory, flags, mode)
            try:
                probe = temp_name(directory / name)  # named like the target's temps: swept with them
                ok = _link(probe_fd, probe)
                if ok:
                    os.unlink(probe)
            finally:
                os.close(probe_fd)
            (_tmpfile_devices if ok else _no_tmpfile_devices).add(dev)
            if not ok:
                return None
        return os.open(directory, flags, mode)
    except OSError:
        return None


_libc: ctypes.CDLL | None = None


def _linkat_empty_path(fd: int, dest: Path) -> int:
    """linkat(fd, "", AT_FDCWD, dest, AT_EMPTY_PATH): 0 or an errno (-1: not available)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        if _libc.linkat(fd, b"", _AT_FDCWD, os.fsencode(dest), _AT_EMPTY_PATH) == 0:
            return 0
        return ctypes.get_errno() or -1
    except (OSError, AttributeError):
        return -1


def _link(fd: int, dest: Path) -> bool:
    """Give the anonymous inode ``fd`` the name ``dest``; False if this system cannot. EEXIST raises."""
    err = _linkat_empty_path(fd, dest)
    if err == 0:
        return True
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(dest))
    try:  # without CAP_DAC_READ_SEARCH: the /proc magic link
        os.link(f"/proc/self/fd/{fd}", dest, follow_symlinks=True)
        return True
    except FileExistsError:
        raise
    except OSError:
        return False


@contextlib.contextmanager
def private_writer(path: str | os.PathLike[str], mode: int = 0o600, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file (readable too, e.g. by a background hasher) that appears at ``path``
    (atomically, replacing it) only on clean exit. ``durable=False`` skips the fsyncs (for data
    that is recomputed when lost, like the checkpoint sidecars)."""
    target = Path(path)
    _require_regular_or_absent(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_anonymous(target.parent, mode, target.name)
    if fd is None:
        with _named_temp_writer(target, mode, durable=durable) as handle:
            yield handle
        return
    with os.fdopen(fd, "r+b") as handle:
        yield handle
        handle.flush()
        if durable:
            os.fsync(handle.fileno())
        _publish(handle.fileno(), target)
    if durable:
        fsync_dir(target.parent)


def _require_regular_or_absent(target: Path) -> None:
    """Refuse, before any work and naming ``target``, a destination that exists but is not a regular
    file: the atomic rename would *replace* a directory entry such as ``/dev/stdout`` (a symlink) or a
    FIFO with a regular file holding the data, and would replace a symlink instead of its target."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        return  # a parent is a file: mkdir/open report it
    if stat.S_ISREG(st.st_mode):
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory (give a file path to write)", str(target))
    raise OSError(errno.EINVAL, "not a regular file (a symlink, FIFO, device or socket), refusing to replace it "
                  "(give the path of a new or regular file; plaintext is never streamed to a pipe or terminal)",
                  str(target))


def _publish(fd: int, target: Path) -> None:
    try:
        if _link(fd, target):
            return
    except FileExistsError:
        pass
    else:  # cannot link after all (probe passed, e.g. a permission changed): copy out
        with _named_temp_writer(target, 0o600) as out:
            offset = 0
            while chunk := os.pread(fd, 1 << 20, offset):
                out.write(chunk)
                offset += len(chunk)
        return
    # ``target`` exists: name the complete file next to it, then rename over it (atomic replace).
    tmp = temp_name(target)
    _register(str(tmp))
    try:
        if not _link(fd, tmp):
            raise OSError(errno.EXDEV, "cannot link the written file", str(tmp))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _unregister(str(tmp))


@contextlib.contextmanager
def _named_temp_writer(target: Path, mode: int, *, durable: bool = True) -> Iterator[BinaryIO]:
    tmp = temp_name(target)
    _register(str(tmp))
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        with os.fdopen(fd, "r+b") as handle:
            os.fchmod(handle.fileno(), mode)
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
        if durable:
            fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        _unregister(str(tmp))


# -- hashing what was written, off the critical path ------------------------------------------


class BackgroundFileHasher:
    """SHA-256 of the bytes flushed to ``fd``, computed by a worker thread that reads them back
    from the page cache (``preadv`` on its own duplicate descriptor).

    The writer calls :meth:`advance` after each flushed write; hashing then overlaps encryption,
    writing and the final fsync instead of adding a second pass in the writer's thread
    (``hashlib`` and ``preadv`` release the GIL). :meth:`hexdigest` waits for the result.
    """

    CHUNK = 4 << 20

    def __init__(self, fd: int) -> None:
        self._fd = os.dup(fd)
        self._sha = hashlib.sha256()
        self._written = 0
        self._hashed = 0
        self._done = False
        self._cancelled = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="securetrain-file-hash", daemon=True)
        self._thread.start()

    @property
    def count(self) -> int:
        return self._written

    def advance(self, n: int) -> None:
        with self._cond:
            self._written += n
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def cancel(self) -> None:
        """Stop early and wait for the worker (the digest is then meaningless)."""
        with self._cond:
            self._cancelled = True
            self._done = True
            self._cond.notify()
        self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._sha.hexdigest()

    def _run(self) -> None:
        view = memoryview(bytearray(self.CHUNK))
        try:
            while True:
                with self._cond:
                    while self._hashed == self._written and not self._done:
                        self._cond.wait()
                    target = self._written
                    if self._hashed == target or self._cancelled:
                        return
                while self._hashed < target and not self._cancelled:
                    n = min(self.CHUNK, target - self._hashed)
                    got = os.preadv(self._fd, [view[:n]], self._hashed)
                    if got <= 0:
                        raise OSError(errno.EIO, "file shorter than what was written")
                    self._sha.update(view[:got])
                    self._hashed += got
        except BaseException as exc:  # reported by hexdigest()
            self._error = exc
        finally:
            os.close(self._fd)


# -- signal paths for named temps -----------------------------------------------------------

_FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None  # what signal.signal returns
_installed: dict[int, _Handler] = {}


def _on_fatal_signal(signum: int, frame: object) -> None:
    for name in list(_live_temps):
        with contextlib.suppress(OSError):
            os.unlink(name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _register(name: str) -> None:
    with _handlers_lock:
        _live_temps.add(name)
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; exceptions still clean up
        for sig in _FATAL_SIGNALS:
            if sig not in _installed and signal.getsignal(sig) is signal.SIG_DFL:
                _installed[sig] = signal.signal(sig, _on_fatal_signal)


def _unregister(name: str) -> None:
    with _handlers_lock:
        _live_temps.discard(name)
        if _live_temps or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(_installed.items()):
            if signal.getsignal(sig) is _on_fatal_signal:
                signal.signal(sig, previous)
            del _installed[sig]


# -- sweeping temps of dead writers -----------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temps(directory: str | os.PathLike[str], *, prefix: str = "", max_age_s: float = 3600.0) -> list[Path]:
    """Remove ``.<prefix>*.tmp`` temps of dead writers in ``directory``; return what was removed.

    A temp named by :func:`temp_name` is stale when it was written on this host by a pid that no
    longer exists; any temp (including ``tempfile`` names) untouched for ``max_age_s`` is stale.
    """
    removed: list[Path] = []
    now = time.time()
    me = host_tag()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith("." + prefix) or not name.endswith(".tmp"):
            continue
        m = _TEMP_RE.match(name)
        if m is None and not _LEGACY_TEMP_RE.match(name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        dead = m is not None and m["host"] == me and int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"]))
        if dead or now - st.st_mtime > max_age_s:
            try:
                os.unlink(entry.path)
            except OSError:  # gone already, or not ours to remove (read-only directory)
                continue
            removed.append(Path(entry.path))
    return removed

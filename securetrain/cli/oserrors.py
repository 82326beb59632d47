"""One line with a hint for an :class:`OSError`, for the root command's error handler.

``OSError`` carries ``strerror`` and up to two file names; the line names what failed and says what
to do next. The paths shown are the ones the operator passed (or derived from them): no file
content, no traceback, no locals.
"""

from __future__ import annotations

import errno

_HINTS: dict[int, str] = {
    errno.ENOSPC: "free disk space (or choose another output location) and run the command again",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota, then run again",
    errno.EROFS: "the file system is read-only: choose a writable output location",
    errno.EACCES: "check the permissions of that path, or choose another location",
    errno.EPERM: "check the permissions of that path, or choose another location",
    errno.EISDIR: "a folder is in the way: give a file path, or a folder as the target of a folder input",
    errno.ENOTDIR: "a file is in the way where a folder is needed: choose another output path",
    errno.EEXIST: "remove it or choose another output path",
    errno.ENOENT: "check the path (and that its parent folder exists)",
    errno.ENOTEMPTY: "the folder is not empty: empty it or choose another",
    errno.EMFILE: "too many open files: raise `ulimit -n` or use fewer workers",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EIO: "the device reported an I/O error: check the disk",
}


def describe_os_error(exc: OSError) -> str:
    """``<what failed>: <path> (hint: <next step>)`` on one line."""
    what = exc.strerror or type(exc).__name__
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    where = " -> ".join(names)
    text = f"{what}: {where}" if where else (what if exc.strerror else f"{what}: {exc}")
    hint = _HINTS.get(exc.errno or -1)
    line = f"{text} (hint: {hint})" if hint else text
    return " ".join(line.split())  # one line, whatever the message held

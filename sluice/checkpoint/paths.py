"""What a path names, for the messages of the commands that read a model or write one.

pathlib's `exists()` / `is_file()` answer False for a symbolic link loop, a FIFO or a device alike, which made a
FIFO named `x.gguf` "not found" and let a writer replace a device node or a link loop with its output.
"""

from __future__ import annotations

import errno
import os
import stat

_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"))


def path_kind(path: str | os.PathLike[str]) -> str:
    """What `path` names, symbolic links followed: "file" (regular), "directory" or "missing", else a phrase for an
    error message: "a FIFO", "a character device", "a block device", "a socket", "a symbolic link loop", "a symbolic
    link to a missing target". Other errors (permission denied on a parent, a name too long) raise OSError."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "a symbolic link to a missing target" if os.path.islink(path) else "missing"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        raise
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return next((name for test, name in _SPECIAL if test(mode)), "not a regular file")


def output_kind(path: str | os.PathLike[str]) -> str:
    """path_kind, but "missing" only when nothing at all has the name (a dangling symbolic link is not missing)."""
    return path_kind(path) if os.path.lexists(path) else "missing"

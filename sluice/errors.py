"""Typed errors. Each names the file, tensor or field at fault and says what to do."""

from __future__ import annotations

import errno


class SluiceError(Exception):
    """Base class: the CLI prints these as one clean line (no traceback) and exits non-zero."""


class CheckpointError(SluiceError):
    """A checkpoint file is missing, truncated or malformed.

    `file` and `tensor` (when known) are kept as attributes so callers and tests can check what was named.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = []
        if file is not None:
            where.append(f"file {file}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(prefix + message)


class ConfigError(SluiceError):
    """config.json (or an option) holds a value sluice cannot run: names the field and the supported values.

    `file` (the config file) and `field` (its key, dotted for nested ones: `rope_parameters.factor`), when given,
    are kept as attributes and prefixed to the message like CheckpointError's file and tensor.
    """

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None):
        self.file = file
        self.field = field
        where = []
        if file is not None:
            where.append(f"file {file}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(prefix + message)


class BudgetError(SluiceError):
    """The memory budget cannot hold what one step needs; the message states the smallest budget that works."""


class ClusterError(SluiceError):
    """The Ray cluster of `sluice serve --ray` cannot be reached, or cannot run the model's replicas (Ray's words)."""


class RequestError(SluiceError):
    """A malformed generation request (bad sampling parameter, prompt too long, ...)."""


class ContextLengthError(RequestError):
    """A prompt that does not fit in the model's context (the server answers it as `context_length_exceeded`)."""


# What to do about the OSErrors a user can fix, appended to their reason.
OS_ERROR_ADVICE = {
    errno.ENOSPC: "the disk is full: free space on it, or write somewhere else",
    errno.EDQUOT: "the disk quota is used up: free space, or write somewhere else",
    errno.EACCES: "check the permissions of the file and its folder",
    errno.EPERM: "check the permissions of the file and its folder",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENOENT: "check the path",
}


def describe_os_error(e: OSError) -> str:
    """`<reason> (<what to do>)` for an OSError (its path is not included)."""
    if e.errno is None and " requested and " in str(e):  # numpy's tofile: the OS took only part of a write
        return f"only part of a write went through ({e}), as when the disk is full: free space on it, or write " \
               "somewhere else"
    reason = e.strerror or str(e)
    advice = OS_ERROR_ADVICE.get(e.errno)
    return f"{reason} ({advice})" if advice else reason


class OutputError(SluiceError):
    """Writing an output failed (disk full, no permission, read-only file system): names the path and what to do.

    `note` says what became of the partial output (the writers remove it)."""

    def __init__(self, path: object, error: OSError, note: str = ""):
        self.path = str(path)
        self.errno = error.errno
        super().__init__(f"cannot write {path}: {describe_os_error(error)}{'; ' + note if note else ''}")


class SluiceWarning(UserWarning):
    """sluice's own warnings: the CLI prints each as one `sluice CMD: warning: ...` line."""


class MemoryWarning(SluiceWarning):
    """A chosen budget may not fit in the memory this process can take."""


class ModelFileWarning(SluiceWarning):
    """A model file was replaced (renamed over) or removed on disk after a reader opened it: the run goes on with
    the version it opened, the one its header described, and the warning says so once per file."""

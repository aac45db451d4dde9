"""Typed errors. Each names the file, tensor or field at fault and says what to do."""

from __future__ import annotations


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


class RequestError(SluiceError):
    """A malformed generation request (bad sampling parameter, prompt too long, ...)."""


class MemoryWarning(UserWarning):
    """A chosen budget may not fit in the memory this process can take; the CLI prints it as one `warning:` line."""

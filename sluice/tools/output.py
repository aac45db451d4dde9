"""Writing a model folder safely: everything goes into `OUT.partial` (marked as sluice's) and is renamed to `OUT` at
the end, so a crash never leaves a folder that looks like a model (make-model, inflate, the MLX and GGUF exports)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from ..checkpoint.paths import output_kind
from ..errors import SluiceError

_PARTIAL_MARKER = ".sluice-make-model"  # marks OUT.partial as ours, so a rerun may delete it
#: the files beside the weights a re-encoded model folder keeps from its source (the FP8 and MLX exports)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json")


def copy_side_files(src: Path, dst: Path) -> None:
    """SIDE_FILES that `src` has, copied into `dst`."""
    for side in SIDE_FILES:
        if (src / side).is_file():
            shutil.copyfile(src / side, dst / side)


class Tally:
    """(name, tensor) pairs passed through as they are written: `count` of them, and `progress(nbytes)` after each."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]], progress: Callable[[int], object] | None):
        self._tensors, self._progress, self.count = tensors, progress, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors:
            self.count += 1
            yield name, t
            if self._progress is not None:
                self._progress(t.numel() * t.element_size())


class OutputExistsError(SluiceError):
    """The output folder exists and is not empty (and --force was not given, or it is not a model folder)."""


@contextmanager
def writing_model(out: Path, force: bool) -> Iterator[Path]:
    """Check OUT may be written, then yield a fresh OUT.partial (marked as ours) to write the model into; on success
    it replaces OUT, on any error it is removed. So a crash never leaves a half-valid model at OUT."""
    _check_output(out, force)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        if not (partial / _PARTIAL_MARKER).exists():
            raise OutputExistsError(f"{partial} exists and was not made by sluice make-model; move it away")
        shutil.rmtree(partial)  # a crashed earlier run
    partial.mkdir(parents=True)
    (partial / _PARTIAL_MARKER).touch()
    try:
        yield partial
        (partial / _PARTIAL_MARKER).unlink()
        _replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _check_output(out: Path, force: bool) -> None:
    kind = output_kind(out)  # (pathlib's exists() is False for a symbolic link loop, which rename then replaced)
    if kind == "missing":
        return
    if kind != "directory":
        raise OutputExistsError(f"{out} exists and is {'a file' if kind == 'file' else kind}, not a directory; "
                                "choose another OUT")
    if not any(out.iterdir()):
        return
    if not force:
        raise OutputExistsError(f"{out} exists and is not empty; pass --force to replace it")
    if not (out / "config.json").is_file():
        raise OutputExistsError(
            f"{out} is not empty and holds no config.json; --force only replaces a model folder, so move it away"
        )


def _replace(partial: Path, out: Path) -> None:
    """Rename the finished folder into place, moving an old `out` aside first and deleting it after."""
    old = None
    if out.exists():
        old = out.with_name(out.name + f".old-{os.getpid()}")
        os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        shutil.rmtree(old)

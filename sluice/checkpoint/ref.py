"""TensorRef: where one tensor's bytes are. The unit the I/O layer reads."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from .formats import BY_NAME, BlockFormat

# safetensors dtype code -> (bytes per element, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F64": (8, torch.float64),
    "F32": (4, torch.float32),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I64": (8, torch.int64),
    "I32": (4, torch.int32),
    "I16": (2, torch.int16),
    "I8": (1, torch.int8),
    "U8": (1, torch.uint8),
    "U32": (4, torch.uint32),
    "BOOL": (1, torch.bool),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
}


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (inverse of DTYPES)."""
    for code, (_, dt) in DTYPES.items():
        if dt == dtype:
            return code
    raise ValueError(f"no safetensors dtype for {dtype}")


@dataclass(frozen=True)
class FileStamp:
    """Which version of a file a header described: `path` plus device, inode, size and mtime (ns) from fstat.

    Readers compare a file's fstat with its stamp when they open it and before each batch they read from it, so a
    file replaced, truncated, extended or rewritten after its header was read ends in a CheckpointError naming it
    instead of shifted bytes or a SIGBUS. `check` costs one fstat.
    """

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> FileStamp:
        """The stamp of `path` from an fstat/stat result."""
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self, fd: int, tensor: str | None = None) -> None:
        """CheckpointError naming the file (and `tensor`) when the open file `fd` is not this version any more."""
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise CheckpointError(f"cannot stat: {e.strerror or e}", file=self.path, tensor=tensor) from e
        self.compare(st, tensor)

    def moved(self) -> str | None:
        """What happened to the path since this version was opened, or None if it still names it: another file
        renamed over it, or the file removed or renamed away. A descriptor opened before still reads this version."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "was removed or renamed away"
        except OSError as e:
            return f"cannot be looked up any more ({e.strerror or e})"
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return "was replaced by another file"
        return None

    def compare(self, st: os.stat_result, tensor: str | None = None) -> None:
        """CheckpointError naming the file (and `tensor`) when `st`, an fstat of it, shows another file or version."""
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            raise CheckpointError(
                "was replaced by another file after its header was read; reload the model to use the new file",
                file=self.path, tensor=tensor,
            )
        if st.st_size != self.size:
            how = "truncated" if st.st_size < self.size else "extended"
            raise CheckpointError(
                f"changed on disk after its header was read: {how} from {self.size} to {st.st_size} bytes "
                "(overwritten or re-downloaded in place?); reload the model once the file is complete",
                file=self.path, tensor=tensor,
            )
        if st.st_mtime_ns != self.mtime_ns:
            raise CheckpointError(
                "changed on disk after its header was read: rewritten in place (same size, new modification "
                "time), so its bytes may no longer be the ones the header describes; reload the model",
                file=self.path, tensor=tensor,
            )


@dataclass(frozen=True)
class TensorRef:
    """One tensor inside a checkpoint file: absolute byte `offset` in `path`, `nbytes`, dtype code, shape.

    `dtype` is a safetensors code (DTYPES) or, for a GGUF tensor, the ggml type name (checkpoint/formats.py: "F16",
    "Q4_K", ...); the plain GGUF types F32/F16/BF16 use the same codes as safetensors. A block format
    (`quantized`) has no torch dtype: its `nbytes` are the stored blocks, `shape` is the logical torch-order shape
    (GGUF dims reversed), and rows (the last dim) are whole blocks, `row_nbytes` bytes each.

    `rope_heads` > 0 marks a q/k projection whose rows llama.cpp's converter permuted for its interleaved rope
    (llama-arch GGUFs: Mixtral); `row_order()` gives the row index that restores Hugging Face order. Rows are
    whole blocks, so the permutation is exact on quantized bytes too; `io.read_tensor` applies it.

    `stamp`: the version of the file the header was read from (None when the ref was made by hand); readers
    refuse to read the tensor from any other version (see FileStamp). Not part of equality.

    `mlx`: set on the `weight` of an MLX affine-quantized Linear (checkpoint/mlx_index.py). The ref is then its
    packed uint32 codes (`dtype` "mlx4", "mlx8", ...; `shape` the logical [..., out, in]) and `mlx` holds the bits,
    group size and the `scales` / `biases` tensors; `io.read_tensor` dequantizes the three.

    `fp8`: set on the `weight` of an FP8 block-quantized Linear (checkpoint/fp8_index.py: DeepSeek-V3 / Kimi K2 /
    Qwen3 FP8 uploads). The ref is then its float8_e4m3fn bytes (`dtype` "fp8_e4m3", one byte a weight; `shape` the
    [..., out, in] they hold) and `fp8` holds the block size and the `weight_scale_inv` tensor; `io.read_tensor`
    dequantizes the two.

    `values`: the name of the elementwise map a converter applied to the values on the way to the file (STORED
    below: llama.cpp and mlx-lm store a zero-centred norm weight w as its scale 1 + w, llama.cpp a Gated DeltaNet's
    A_log as -exp(A_log)); `io.read_tensor` undoes it in float32, so the tensor reads as the Hugging Face values.
    Such a tensor is always dequantized at load, never kept in its blocks (quant/linear.py quant_spec).
    """

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    rope_heads: int = 0
    stamp: FileStamp | None = field(default=None, compare=False, repr=False)
    mlx: MLXQuant | None = None
    values: str = ""  # a key of STORED: how the converter changed the values ("" none)
    fp8: FP8Quant | None = None

    @property
    def quantized(self) -> bool:
        """A block format (Q4_K, Q8_0, ...), MLX affine codes or FP8 block-scaled codes: bytes are not the values."""
        return self.mlx is not None or self.fp8 is not None or (self.dtype not in DTYPES and self.dtype in BY_NAME)

    @property
    def format(self) -> BlockFormat:
        """The ggml block format of this tensor (plain F32/F16/BF16 are blocks of one element)."""
        fmt = BY_NAME.get(self.dtype)
        if fmt is None:
            raise CheckpointError(f"dtype {self.dtype} is not a ggml type", file=self.path, tensor=self.name)
        return fmt

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._plain()[1]

    @property
    def itemsize(self) -> int:
        return self._plain()[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (the last dimension) as stored: elements x itemsize, or whole blocks."""
        cols = self.shape[-1] if self.shape else 1
        if self.fp8 is not None:  # one byte a weight (the scales are their own tensor)
            return cols
        if self.dtype in DTYPES:
            return cols * DTYPES[self.dtype][0]
        return self.format.row_nbytes(cols)

    def row_order(self) -> torch.Tensor | None:
        """Row index [rows] with hf_rows = stored_rows[index], or None when the rows are stored in HF order."""
        if not self.rope_heads:
            return None
        return rope_row_order(self.shape[0], self.rope_heads)

    def _plain(self) -> tuple[int, torch.dtype]:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise CheckpointError(
                f"is stored as {self.dtype}, a block format with no torch dtype or element size; read its raw "
                f"bytes ({self.nbytes}) and dequantize them (sluice/quant)", file=self.path, tensor=self.name,
            ) from None


@dataclass(frozen=True)
class MLXQuant:
    """What makes an MLX affine weight's packed codes values: value = scale * code + bias per group of
    `group_size` consecutive inputs of a row; `scales` and `biases` [..., out, in / group_size] (F32 / F16 / BF16)."""

    bits: int
    group_size: int
    scales: TensorRef
    biases: TensorRef


@dataclass(frozen=True)
class FP8Quant:
    """What makes an FP8 weight's e4m3 codes values: value = code * scale of its block of `block` = (rows, inputs)
    weights (config.json quantization_config.weight_block_size); `scale` is the `weight_scale_inv` tensor
    [..., ceil(out / rows), ceil(in / inputs)] (F32, BF16 or F16)."""

    block: tuple[int, int]
    scale: TensorRef


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q/k rows: `hf = stored[rope_row_order(rows, heads)]`.

    convert_hf_to_gguf.py stores a llama-arch q (k) projection as
    `w.reshape(heads, 2, D/2, ...).swapaxes(1, 2)` so that its interleaved ("NORM") rope pairs adjacent rows,
    where Hugging Face's rotate_half pairs row i with row i + D/2 of each head; stored row h*D + 2i + j holds HF row
    h*D + j*D/2 + i. The inverse is this gather.
    """
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(f"{rows} rows are not {heads} heads of an even head size")
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)  # [rows]


def _unplus_one(x: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    # w = scale - 1 is exact where the scale is within [0.5, 2] (Sterbenz), so a zero-centred norm's 1 + w gives back
    # the stored scale bit for bit there
    return x - 1.0


def _unneg_exp(x: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    if not bool((x < 0).all()):
        raise CheckpointError("holds values >= 0 where the converter stores -exp(A_log) (always negative); the file "
                              "is malformed: re-convert the model", file=ref.path, tensor=ref.name)
    return torch.log(-x.double()).float()  # float64 inside: -exp() of it is the stored value to float32 rounding


@dataclass(frozen=True)
class Stored:
    """One elementwise map a converter applies to a tensor's values on the way to the file, both ways (float32)."""

    what: str  # the stored value as a function of the Hugging Face value w
    store: Callable[[torch.Tensor], torch.Tensor]  # Hugging Face values -> stored (tools/gguf_export.py writes so)
    undo: Callable[[torch.Tensor, TensorRef], torch.Tensor]  # stored values of the ref -> Hugging Face values


#: TensorRef.values -> the map
STORED = {
    # zero-centred RMSNorm weights as their scale (llama.cpp's and mlx-lm's converters of the Gated DeltaNet hybrids)
    "plus_one": Stored("1 + w", lambda w: w + 1.0, _unplus_one),
    # Gated DeltaNet's A_log as the decay rate itself (llama.cpp's ssm_a)
    "neg_exp": Stored("-exp(w)", lambda w: -w.exp(), _unneg_exp),
}


def stored_as(name: str, table: dict[str, str]) -> str:
    """The STORED key `table` (a converter's facts: a whole tensor name, or the suffix after a dot -> key) gives
    tensor `name`, "" when it names none."""
    for key, how in table.items():
        if name == key or name.endswith("." + key):
            return how
    return ""


def unstored(x: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """`ref`'s values `x` as read from the file -> the Hugging Face values, in x's dtype (the inverse of the map
    `ref.values` names, computed in float32; `x` itself when it names none). CheckpointError naming the tensor for
    an unknown map or values the map cannot have produced."""
    if not ref.values:
        return x
    entry = STORED.get(ref.values)
    if entry is None:
        raise CheckpointError(f"values stored as {ref.values!r}, which sluice does not know how to undo",
                              file=ref.path, tensor=ref.name)
    return entry.undo(x.float(), ref).to(x.dtype)

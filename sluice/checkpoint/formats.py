"""The block formats a tensor's bytes can be in, as GGUF numbers and names them (ggml's `ggml_type`).

A block of `block_elems` consecutive values of a row is stored in `block_bytes` bytes; a row of n values takes
n / block_elems blocks, so n must be a multiple of block_elems. Plain types are blocks of one element. The names
are the ones the `gguf` package uses (GGMLQuantizationType), so a format named here is the type of the same name
there. `SUPPORTED` are the ones sluice computes with; the others are known only so that an error can name them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    """One ggml type: its GGUF id, name, and the size of a block in elements and in bytes."""

    ggml_id: int
    name: str
    block_elems: int
    block_bytes: int

    def row_nbytes(self, n: int) -> int:
        """Bytes of a row of `n` values; ValueError when n is not a whole number of blocks."""
        if n % self.block_elems:
            raise ValueError(f"{self.name} rows are whole blocks of {self.block_elems} values, got a row of {n}")
        return n // self.block_elems * self.block_bytes

    @property
    def plain(self) -> bool:
        """One element per block: F32, F16, BF16 and the integer types (no scales to apply)."""
        return self.block_elems == 1


_TABLE = [
    # id, name, block elements, block bytes (ggml.c type_traits; gguf.constants.GGML_QUANT_SIZES)
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20), (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 40), (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210), (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98), (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110), (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1), (25, "I16", 1, 2), (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56), (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17), (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18),
]
BY_ID: dict[int, BlockFormat] = {i: BlockFormat(i, n, e, b) for i, n, e, b in _TABLE}
BY_NAME: dict[str, BlockFormat] = {f.name: f for f in BY_ID.values()}

#: the MLX affine bit widths sluice reads (mlx_lm.convert --q-bits; quant/mlx.py unpacks each)
MLX_BITS = (2, 3, 4, 5, 6, 8)

#: the formats sluice reads and computes with (quant/ggml.py DEQUANTIZABLE, the same set): issue 14's list (Q4_K_M /
#: Q5_K_M files mix K-types, Q6_K, Q8_0), GGUF's MXFP4 (gpt-oss), and the 1-3 bit types of the largest MoE files
#: (issue 32: Unsloth's UD-IQ1_M, UD-TQ1_0, UD-Q2_K_XL, UD-IQ2_XXS / IQ3_XXS, ... mix them per tensor)
SUPPORTED = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
                       "MXFP4", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                       "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"})


class UnsupportedFormat(ValueError):
    """A tensor format sluice cannot compute with. `format` is its name; callers that know the file and tensor wrap
    it into CheckpointError(str(err), file=..., tensor=...)."""

    def __init__(self, fmt: str, why: str = ""):
        self.format = fmt
        supported = ", ".join(sorted(SUPPORTED))
        super().__init__(f"format {fmt} is not supported{': ' + why if why else ''} (sluice reads {supported}); "
                         "convert the file to one of these (llama.cpp's llama-quantize writes them)")

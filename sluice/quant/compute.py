"""How one model computes: every kernel choice that depends on the load options and the CPU, decided once at load
(engine.py from the plan) and handed to each weight and layer as they are built. Nothing here is process-wide, so
two models loaded in one process with different options each keep theirs (tests/test_compute.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .native import attend, prompt
from .native._lib import BEST

#: a prompt pass's query rows from which its SDPA runs on bf16 inputs where the CPU has AMX (Compute.sdpa_widen)
AMX_SDPA_MIN_ROWS = 512


@dataclass(frozen=True)
class Compute:
    """A model's compute settings (LoadOptions -> plan -> here).

    dtype       the compute dtype (activations, resident plain weights)
    bf16_gemm   several bf16 rows multiply on torch's bf16 GEMM (LoadOptions.matmul, resolved for this CPU;
                quant/matmul.py), else widened to float32
    planes      the integer kernels' activation coding (LoadOptions.activations): 2 planes of 8-bit codes (int16,
                finer than bf16) or 1 (int8, llama.cpp's)
    path        the native kernels' path cap (LoadOptions.isa, native/_lib.py): BEST, AVX2 or PORTABLE
    threads     compute threads: torch's and the native pool's (engine.py applies them when the model runs)
    amx         the CPU has AMX bf16 tiles that torch's bf16 GEMM and attention run on (host/cpus.amx_bf16), the
                kernels not capped (--isa auto): a prompt's experts and attention go to torch (prompt_planes,
                attend_prompt)
    """

    dtype: torch.dtype = torch.bfloat16
    bf16_gemm: bool = False
    planes: int = 2
    path: int = BEST
    threads: int = 1
    amx: bool = False

    @property
    def prompt_planes(self) -> int:
        """Planes of 8-bit activation codes at which a prompt's Q4_K rows run prompt.c's integer tiles, 0 where they
        take the GEMM route (bf16 compute dtype only):
          1  activations int8 on a CPU with AVX512-VNNI whose kernels are not capped below it (its VNNI tiles beat
             dequantizing to bf16 for the bf16 GEMM), unless it has AMX: there the GEMM route is faster (a resident
             2,048-token prompt of the peers Q4_K_M, 2 threads, Intel Xeon AMX, medians of 3: 3.28 s on the VNNI
             tiles and attend.c, 2.76 s on the GEMM route, 2.32 s with torch's attention too;
             `benchmarks/quantized/amx_prompt.py`, benchmarks/results/quantized/amx-prompt/run.txt);
          Compute.planes  where several bf16 rows multiply on float32 GEMMs (no bf16 dot products, or --isa avx2)
             on a CPU with AVX2: prompt_avx2.c's tiles beat dequantizing to float32 for the float32 GEMM (numbers
             in native/prompt.py). --isa portable runs the same tiles in plain C (slower than the GEMM, the same
             bits: a capped model computes what the uncapped one does)."""
        if self.dtype is not torch.bfloat16:
            return 0
        if self._vnni_tiles:
            return 1
        return self.planes if not self.bf16_gemm and prompt.avx2() else 0

    @property
    def _vnni_tiles(self) -> bool:
        """int8 activations on prompt.c's VNNI tiles (the CPU has them, the kernels are not capped, no AMX)."""
        return self.planes == 1 and self.path == BEST and prompt.available() and not self.amx

    @property
    def prompt_formats(self) -> frozenset:
        """The GGUF types whose prompt rows take the integer tiles (at prompt_planes): Q4_K on the VNNI tiles,
        Q4_K and Q6_K on the AVX2 ones; none where prompt_planes is 0."""
        planes = self.prompt_planes
        if planes == 0:
            return frozenset()
        return prompt.VNNI_FORMATS if self._vnni_tiles else prompt.AVX2_FORMATS

    def sdpa_widen(self, rows: int) -> bool:
        """Whether a prompt pass of `rows` query rows runs its SDPA on q / k / v widened to float32 with oneDNN's
        bf16 products (quant/matmul.py sdpa: about twice bf16 SDPA's speed on AVX512_BF16 and closer to float64),
        rather than on its bf16 inputs: under bf16 GEMMs, except on AMX for a pass of AMX_SDPA_MIN_ROWS rows or
        more, where torch's bf16 flash attention runs on the tiles and the attention's quadratic cost makes it
        count. Intel Xeon AMX, 8 query / 2 kv heads of 128, causal, 2 threads, medians of 7 (`amx_prompt.py`'s
        attention lines, benchmarks/results/quantized/amx-prompt/attention.txt), widened / bf16: 256 rows 1.72 /
        0.40 ms, 512 5.18 / 1.33, 1,024 10.84 / 4.15, 2,048 32.47 / 13.10 (16 such layers in a 2,048-token prompt
        of the peers Q4_K_M, which takes 1.83-1.93 s resident: benchmarks/results/quantized/breakdown/prompt-2.txt).
        Short passes keep the closer sums (the parity tests' 100-token prompts of the hybrids part from llama.cpp's
        greedy tokens at a near tie on bf16 inputs)."""
        return self.bf16_gemm and (not self.amx or rows < AMX_SDPA_MIN_ROWS)

    @property
    def attend_prompt(self) -> bool:
        """Whether a prompt's causal attention may run attend.c (bf16 products, AVX512_BF16): bf16 on bf16 GEMMs,
        the kernels not capped below AVX-512, and no AMX (torch's bf16 flash attention on AMX tiles: 11.4 ms a layer
        of a 2,048-token prompt, 8 heads of 128, 2 threads, where attend.c takes 90.8;
        benchmarks/results/quantized/amx-prompt; the model took the widened SDPA there, 29.7 ms, until
        sdpa_widen)."""
        return (self.dtype is torch.bfloat16 and self.bf16_gemm and self.path == BEST and attend.available()
                and not self.amx)

    @property
    def attend_prompt_f32(self) -> bool:
        """Whether a prompt's causal attention may run attend_avx2.c (float32 products and probabilities; AVX2 + FMA,
        or its portable twin on `path` PORTABLE, the same bits): bf16 on float32 GEMMs (no bf16 dot products, or
        --isa avx2 / portable). 2,048 tokens, 8 query / 2 kv heads of 128, 2 threads, Intel Xeon capped at AVX2: 47
        ms a layer against torch's SDPA on the bf16 inputs 54 ms, both near this CPU's FMA peak
        (benchmarks/quantized/attend_avx2.py, benchmarks/results/quantized/breakdown/attend-avx2.txt)."""
        return self.dtype is torch.bfloat16 and not self.bf16_gemm and attend.available(float32=True)

    def gemm_rows(self, x: torch.Tensor, min_rows: int) -> bool:
        """Whether x's rows (at least min_rows of them, bf16) go to a bf16 GEMM on weights dequantized to bf16."""
        return self.bf16_gemm and x.shape[0] >= min_rows and x.dtype is torch.bfloat16 and self.dtype is torch.bfloat16

"""sluice: run Mixture-of-Experts language models larger than memory by streaming experts from SSD, exactly.

Importing sluice before torch sets OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=1000 unless the environment names a
policy: torch's OpenMP workers (libgomp) spin ~10 us after each parallel op, then sleep. libgomp's default spins ~3
ms, and on a machine with as many threads as cores that took the CPU from sluice's native pool (its worker started a
job's tasks 4.5 ms per decode token late in all, peers Q4_K_M, resident, 2 threads) and from a streamed prompt's read
workers; sleeping at once makes every torch op of a prompt wake them. 2-core AVX512_BF16 EPYC, this default against
sleeping at once (PASSIVE alone, the default before): resident prefill vs transformers (`benchmarks/compare.py
resident-prefill --rounds 5`) 1.52x / 1.83x against 1.29x / 1.68x at 512 / 2,048 tokens; a streamed 2,048-token
prompt at a 1 GiB ceiling (`MEMORY=512MiB SETS="bf16 q4km" bash benchmarks/prefill/run.sh`) 2,644 vs 2,795 ms on the
peers bf16 file and 2,698 vs 3,001 on its Q4_K_M file. A ~30 us spin (GOMP_SPINCOUNT=3000) was faster resident
still but slower streamed (bf16 2,949 / 3,311 ms in two runs); `benchmarks/knobs.py omp-wait --model MODEL --prompt N`
compares the policies on one model. Set OMP_WAIT_POLICY (or GOMP_SPINCOUNT) yourself to keep another. Imported
after torch with neither set, sluice is too late for libgomp: the first model load says so (host/omp.py).
"""

import os as _os
import sys as _sys

# too late for libgomp when torch came first with its defaults: a model load warns (host/omp.py)
_torch_first = "torch" in _sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys()
if "OMP_WAIT_POLICY" not in _os.environ:  # read once, when torch loads libgomp: so before `import torch`
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # overrides PASSIVE's 0: ~10 us (libgomp: ~100,000 a ms)

from .engine import Model, load
from .errors import BudgetError, CheckpointError, ConfigError, ContextLengthError, RequestError, SluiceError
from .options import LoadOptions
from .host import omp as _omp

_omp.TORCH_FIRST = _torch_first

__all__ = ["load", "Model", "LoadOptions", "SluiceError", "CheckpointError", "ConfigError", "BudgetError",
           "RequestError", "ContextLengthError"]
__version__ = "0.1.0"

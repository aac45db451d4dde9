"""sluice: run Mixture-of-Experts language models larger than memory by streaming experts from SSD, exactly.

Importing sluice before torch sets OMP_WAIT_POLICY=PASSIVE unless the environment names a policy: torch's OpenMP
workers (libgomp) then sleep right after each parallel op. libgomp's default spins ~3 ms first, and on a machine with
as many threads as cores that spinning took the CPU from sluice's native pool (its worker started a job's tasks 4.5
ms per decode token late in all, peers Q4_K_M, resident, 2 threads) and from the read workers of a streamed prompt.
The price is a wake-up at every torch op, which a resident bf16 model pays most. 2-core AVX512_BF16 EPYC, medians of
3 alternated processes (`PYTHONPATH=. .venv/bin/python benchmarks/quantized/omp_wait.py MODEL --prompt N`), passive /
a ~30 us spin (GOMP_SPINCOUNT=3000) / libgomp's default: the 1 GiB demo model, resident, 512-token prefill 189 / 143 /
143 ms, decode 11.1 / 5.6 / 5.5 ms/token; peers bf16, resident, 2,048 tokens 2,356 / 2,092 / 2,122 ms, decode 65.2 /
48.4 / 46.7; peers Q4_K_M, resident, within its noise. But streamed under a 1 GiB ceiling the spin lost: the peers
bf16 prompt took 2,795 ms passive and 2,949 / 3,311 ms in two runs with the 30 us spin (`MEMORY=512MiB
SETS=bf16 bash benchmarks/prefill/run.sh`). So passive stays the default; for a resident model, set GOMP_SPINCOUNT=3000
(with or without OMP_WAIT_POLICY) before starting Python, or OMP_WAIT_POLICY yourself to keep another policy.
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads libgomp: so before `import torch`

from .engine import Model, load
from .errors import BudgetError, CheckpointError, ConfigError, ContextLengthError, RequestError, SluiceError
from .options import LoadOptions

__all__ = ["load", "Model", "LoadOptions", "SluiceError", "CheckpointError", "ConfigError", "BudgetError",
           "RequestError", "ContextLengthError"]
__version__ = "0.1.0"

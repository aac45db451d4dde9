"""sluice: run Mixture-of-Experts language models larger than memory by streaming experts from SSD, exactly.

Importing sluice before torch sets OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=3000 unless the environment names a
policy: torch's OpenMP workers (libgomp) then spin ~30 us after each parallel op and sleep. libgomp's default spins
~3 ms, and on a machine with as many threads as cores that spinning took the CPU from sluice's native pool (its
worker started a job's tasks 4.5 ms per decode token late in all, peers Q4_K_M, resident, 2 threads); sleeping at
once (PASSIVE alone, the default before) made every torch op of a prompt or a bf16 decode step wake its workers.
2-core AVX512_BF16 EPYC, medians of 3 alternated processes (`PYTHONPATH=. .venv/bin/python
benchmarks/quantized/omp_wait.py MODEL --prompt N`), this default / passive / libgomp's default: the 1 GiB demo
model, 512-token prefill 143 / 189 / 143 ms, decode 5.6 / 11.1 / 5.5 ms/token; peers bf16, 2,048 tokens 2,092 /
2,356 / 2,122 ms, decode 48.4 / 65.2 / 46.7; peers Q4_K_M (native kernels) is noisy either way: prefill 2,708 / 2,914
/ 3,946, 2,346 / 2,881 / 3,654 and 3,103 / 2,718 / 4,186 ms in three runs (the first two with other prompt ids),
decode 13.3 / 12.1 / 12.2, 11.8 / 11.8 / 13.6 and 13.1 / 14.4 / 13.2 ms/token. Set OMP_WAIT_POLICY yourself to keep
another policy.
"""

import os as _os

if "OMP_WAIT_POLICY" not in _os.environ:  # read once, when torch loads libgomp: so before `import torch`
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # overrides PASSIVE's 0: ~30 us (libgomp: ~100,000 a ms)

from .engine import Model, load
from .errors import BudgetError, CheckpointError, ConfigError, ContextLengthError, RequestError, SluiceError
from .options import LoadOptions

__all__ = ["load", "Model", "LoadOptions", "SluiceError", "CheckpointError", "ConfigError", "BudgetError",
           "RequestError", "ContextLengthError"]
__version__ = "0.1.0"

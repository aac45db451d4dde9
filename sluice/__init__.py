"""sluice: run Mixture-of-Experts language models larger than memory by streaming experts from SSD, exactly.

Importing sluice before torch sets OMP_WAIT_POLICY=PASSIVE unless the environment names a policy: by default
torch's OpenMP workers (libgomp) spin after every parallel op, and on a machine with as many threads as cores
that spinning took the CPU from sluice's native pool: its worker started a job's tasks 4.5 ms per decode token late
in all (peers Q4_K_M, resident, 2 threads), 0.2 ms when passive; a 32-token prompt's prefill took 885 vs 780 ms and
decode 28.0 vs 27.5 ms/token (medians of 8 alternated processes, benchmarks/quantized/omp_wait.py). Set
OMP_WAIT_POLICY yourself to keep another policy.
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads libgomp: so before `import torch`

from .engine import Model, load
from .errors import BudgetError, CheckpointError, ConfigError, ContextLengthError, RequestError, SluiceError
from .options import LoadOptions

__all__ = ["load", "Model", "LoadOptions", "SluiceError", "CheckpointError", "ConfigError", "BudgetError",
           "RequestError", "ContextLengthError"]
__version__ = "0.1.0"

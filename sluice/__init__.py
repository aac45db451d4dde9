"""sluice: run Mixture-of-Experts language models larger than memory by streaming experts from SSD, exactly."""

import os as _os
import sys as _sys

# torch's OpenMP threads spin while they wait for work (libgomp's default), which is free on an idle machine and a
# cliff on a shared one: with one other busy process on 2 cores, resident decode went from ~85 to 150-313 ms/token
# and a second sluice process made a streamed run 8x slower; passive waiting gives each its fair share
# (benchmarks/contention.py). libgomp reads the policy once, when torch loads it, so it is set before the first
# `import torch`; the user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "torch" not in _sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys():
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from .engine import Model, load
from .errors import BudgetError, CheckpointError, ConfigError, ContextLengthError, RequestError, SluiceError
from .options import LoadOptions

__all__ = ["load", "Model", "LoadOptions", "SluiceError", "CheckpointError", "ConfigError", "BudgetError",
           "RequestError", "ContextLengthError"]
__version__ = "0.1.0"

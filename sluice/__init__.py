"""sluice: run Mixture-of-Experts language models larger than memory by streaming experts from SSD, exactly."""

from .engine import Model, load
from .errors import BudgetError, CheckpointError, ConfigError, ContextLengthError, RequestError, SluiceError
from .options import LoadOptions

__all__ = ["load", "Model", "LoadOptions", "SluiceError", "CheckpointError", "ConfigError", "BudgetError",
           "RequestError", "ContextLengthError"]
__version__ = "0.1.0"

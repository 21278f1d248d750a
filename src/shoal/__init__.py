"""shoal: distributed training for PyTorch from one validated config.

`shoal.train(...)` is `shoal train` from Python (api.py); the training loop's package is shoal.training.
"""

from shoal.api import train
from shoal.clock import STARTED_AT  # this process's start, for summary.json's recovery times
from shoal.config import Config, load_config
from shoal.errors import TrainingError, UserError

__all__ = ["STARTED_AT", "Config", "TrainingError", "UserError", "load_config", "train"]
__version__ = "0.1.0"

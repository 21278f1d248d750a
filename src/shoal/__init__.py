"""shoal: distributed training for PyTorch from one validated config.

`shoal.train(...)` is `shoal train` from Python (api.py); the training loop's package is shoal.training.
"""

import shoal.clock  # noqa: F401 - first: this process's start, for summary.json's recovery times
from shoal.api import train
from shoal.config import Config, load_config
from shoal.errors import TrainingError, UserError

__all__ = ["Config", "TrainingError", "UserError", "load_config", "train"]
__version__ = "0.1.0"

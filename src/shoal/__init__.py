"""shoal: distributed training for PyTorch from one validated config.

`shoal.train(...)` is `shoal train` from Python (api.py); `shoal.Session` is shoal inside your own loop
(training/session.py); the training loop's package is shoal.training.
"""

import shoal.clock  # noqa: F401 - first: this process's start, for summary.json's recovery times
from shoal.api import train
from shoal.config import Config, load_config
from shoal.errors import TrainingError, UserError

__all__ = ["Config", "Session", "TrainingError", "UserError", "load_config", "train"]


def __getattr__(name: str):
    if name == "Session":  # imports torch and the training package: only when asked for
        from shoal.training.session import Session

        return Session
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
__version__ = "0.1.0"

"""shoal: distributed training for PyTorch from one validated config."""

import time

STARTED_AT = time.time()  # this process's start, for the recovery-time breakdown in summary.json

# ruff: noqa: E402

from shoal.config import Config, load_config
from shoal.errors import UserError

__all__ = ["Config", "UserError", "load_config"]
__version__ = "0.1.0"

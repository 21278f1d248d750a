"""shoal: distributed training for PyTorch from one validated config."""

from shoal.config import Config, load_config
from shoal.errors import UserError

__all__ = ["Config", "UserError", "load_config"]
__version__ = "0.1.0"

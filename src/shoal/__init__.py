"""shoal: distributed training for PyTorch from one validated config.

`shoal.train(...)` is `shoal train` from Python (api.py); `shoal.Session` is shoal inside your own loop
(training/session.py); the training loop's package is shoal.training.

The names below are imported when first asked for, after a check of torch's release (compat.py): on a
torch older than shoal supports, `shoal.train` or `shoal.Session` raises one line naming the upgrade,
and the command line says it before importing anything else (cli/__init__.py).
"""

import importlib

import shoal.clock  # noqa: F401 - first: this process's start, for summary.json's recovery times

__all__ = ["Config", "Session", "TrainingError", "UserError", "load_config", "train"]
__version__ = "0.1.0"

_WHERE = {"train": "shoal.api", "Config": "shoal.config", "load_config": "shoal.config",
          "Session": "shoal.training.session", "UserError": "shoal.errors", "TrainingError": "shoal.errors"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    if _WHERE[name] != "shoal.errors":
        from shoal.compat import require_supported_torch

        require_supported_torch()
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

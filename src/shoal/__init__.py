"""shoal: distributed training for PyTorch from one validated config."""

import types

import shoal.train as _train_package
from shoal.clock import STARTED_AT  # this process's start, for summary.json's recovery times
from shoal.config import Config, load_config
from shoal.errors import TrainingError, UserError


class _CallableTrainPackage(types.ModuleType):
    """`shoal.train` is the package of the training loop, and, called, `shoal train` from Python
    (shoal/api.py): the package must keep the name, as every import of a module below it sets it."""

    def __call__(self, *args, **kwargs):
        """shoal.api.train: train as `shoal train` would; returns summary.json."""
        from shoal.api import train

        return train(*args, **kwargs)


_train_package.__class__ = _CallableTrainPackage

__all__ = ["STARTED_AT", "Config", "TrainingError", "UserError", "load_config", "train"]
__version__ = "0.1.0"

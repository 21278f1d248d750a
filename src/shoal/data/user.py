"""A user's own data set: data.source = "package.module:function".

The function is called with the [data] config section (on every rank, and once by the preflight) and
returns a map-style dataset (len() and [i] -> a dict of tensors) or a `UserData` (models/spec.py) with
a validation set, a collate function and the DataSpec the model needs. Which samples make a global
batch stays the sampler's business (sampler.py: a pure function of the seed and the step), so resume
is exact and every layout sees the same batches, as with the built-in sources. The first samples are
checked when the source is built, so a wrong return type or samples of differing shapes are a
one-line error before any worker starts.
"""

from __future__ import annotations

import torch

from shoal.config import DataConfig
from shoal.errors import UserError
from shoal.models.registry import import_user_callable
from shoal.models.spec import Batch, DataSpec, UserData

CHECKED = 8  # samples looked at when the source is built


class Holdout:
    """The last `n` samples of `data` (or, with tail=False, all but them)."""

    def __init__(self, data, n: int, tail: bool):
        self.data, self.offset = data, len(data) - n if tail else 0
        self.n = n if tail else len(data) - n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.data[self.offset + i]


class UserSource:
    def __init__(self, cfg: DataConfig):
        name = cfg.source
        got = import_user_callable("data.source", name)(cfg)
        data = got if isinstance(got, UserData) else UserData(train=got)
        where = f'data.source = "{name}"'
        for what, ds in (("training set", data.train), ("validation set", data.val)):
            if ds is not None and not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
                raise UserError(f"{where} returned {type(ds).__name__} as its {what}; return a map-style dataset "
                                f"(len() and [i] -> dict of tensors) or shoal.models.spec.UserData(train, val, "
                                f"collate, spec)")
        self.train, self.val = data.train, data.val
        if self.val is None:  # hold out the tail, as the text sources do
            n_val = max(int(len(self.train) * cfg.val_fraction), 1)
            if len(self.train) - n_val < 1:
                raise UserError(f"{where} has {len(self.train)} samples, too few to hold out a validation split; "
                                f"return more, or a validation set (UserData(val=...))")
            self.train, self.val = Holdout(data.train, n_val, tail=False), Holdout(data.train, n_val, tail=True)
        self.collate = data.collate or stack
        self.where = where
        self.spec = data.spec or DataSpec(kind="custom")
        self.num_train, self.num_val = len(self.train), len(self.val)
        if self.num_train < 1 or self.num_val < 1:
            raise UserError(f"{where} gave {self.num_train} training and {self.num_val} validation samples; both "
                            f"must be at least 1")
        if data.collate is None:
            for ds in (self.train, self.val):
                check_samples([ds[i] for i in range(min(CHECKED, len(ds)))], where)

    def _batch(self, ds, idx: torch.Tensor) -> Batch:
        samples = [ds[i] for i in idx.tolist()]
        if self.collate is stack:
            check_samples(samples, self.where)
        return self.collate(samples)

    def train_batch(self, idx: torch.Tensor, step: int = 0) -> Batch:
        return self._batch(self.train, idx)

    def val_batch(self, idx: torch.Tensor) -> Batch:
        return self._batch(self.val, idx)


def check_samples(samples: list, where: str) -> None:
    """Samples the default collate can stack: dicts of tensors with the first one's keys and shapes."""
    first = samples[0]
    if not isinstance(first, dict) or not all(isinstance(v, torch.Tensor) for v in first.values()):
        raise UserError(f"{where}: a sample is a {type(first).__name__}, not a dict of tensors; return dicts such as "
                        f'{{"input": tensor, "target": tensor}}, or pass a collate function (UserData(collate=...))')
    for s in samples[1:]:
        if not isinstance(s, dict) or s.keys() != first.keys():
            raise UserError(f"{where}: samples differ in their keys ({sorted(first)} and "
                            f"{sorted(s) if isinstance(s, dict) else type(s).__name__}); give every sample the same "
                            f"keys, or pass a collate function (UserData(collate=...))")
        for k, v in s.items():
            if not isinstance(v, torch.Tensor) or v.shape != first[k].shape or v.dtype != first[k].dtype:
                got = f"{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise UserError(f'{where}: "{k}" is {got} in one sample and {list(first[k].shape)} '
                                f"{first[k].dtype} in another; make every sample one shape (pad or crop), or pass "
                                f"a collate function (UserData(collate=...))")


def stack(samples: list[Batch]) -> Batch:
    """The default collate: each key's tensors stacked along a new first (sample) dimension."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}

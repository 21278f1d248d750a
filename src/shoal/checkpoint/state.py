"""What a checkpoint holds, split by how it is stored.

Tensors (model, optimizer state) go through torch.distributed.checkpoint, sharded and resharded on
load for any world size or layout. Everything else is small and goes to JSON, readable without
unpickling: the step, the sampler position, the LR schedule, the grad scaler, counters, and each
rank's RNG states (python, numpy, torch CPU and CUDA) in its own file.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _flatten_optim_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shoal.config import Config, tomllib, validate_config
from shoal.parallel.zero import local_optimizer

TRAIN_STATE = "train_state.json"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.json"


# The optimizer state is stored flat, one key per parameter ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"): no list whose length depends on the layout (a ZeRO 1 rank's groups hold
# only its own parameters), so any layout loads any other's checkpoint.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
# written into train_state.json; a checkpoint of another format is refused at resume, in one line
CHECKPOINT_FORMAT = 2


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The DCP state dict: fully-qualified names, independent of DDP/compile/checkpoint wrappers and of
    the layout (FSDP2 gives DTensor shards; under ZeRO 1 each rank gives the state it holds, and the
    union over ranks is the state of the unsharded optimizer). DCP reshards between layouts on load."""
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, local_optimizer(optimizer), options=FLAT_OPTIM)}


class TensorStateCache:
    """tensor_state(), reused between saves (as torchtitan does for the model). Its tensors ARE the live
    parameters, buffers and optimizer moments, updated in place by training, so only the optimizer's
    hyperparameters (the scheduled learning rate) need refreshing; it is rebuilt whenever one of those
    tensors was replaced (a load, the optimizer's first step). Building it costs ~10 ms per save for a
    small model: most of an async save's stall."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._key: tuple[int, ...] | None = None
        self._state: dict | None = None

    def _identity(self) -> tuple[int, ...] | None:
        ids = [id(t) for t in self.model.parameters()] + [id(t) for t in self.model.buffers()]
        for per_param in local_optimizer(self.optimizer).state.values():
            if not all(isinstance(v, torch.Tensor) for v in per_param.values()):
                return None  # a plain number in the state is copied, not shared: never reuse
            ids += [id(v) for v in per_param.values()]
        return tuple(ids)

    def get(self) -> dict:
        key = self._identity()
        local = local_optimizer(self.optimizer)
        if key is None or key != self._key or self._state is None:
            # nested optimizer state here (its groups can be refreshed in place), flattened per save
            self._state = {"model": get_model_state_dict(self.model),
                           "optim": get_optimizer_state_dict(self.model, local)}
            self._key = key
        else:
            for saved, live in zip(self._state["optim"]["param_groups"], local.param_groups, strict=True):
                saved.update((k, v) for k, v in live.items() if k != "params")
        # torch's own flattening (what set_optimizer_state_dict(options=FLAT_OPTIM) reads back); it pops
        # each group's "params", so it gets copies of the groups
        optim = self._state["optim"]
        groups = [dict(g) for g in optim["param_groups"]]
        flat = _flatten_optim_state_dict({"state": optim["state"], "param_groups": groups})
        return {"model": self._state["model"], "optim": flat}


def apply_tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_model_state_dict(model, state["model"])
    local = local_optimizer(optimizer)
    # torch cannot load flat state into an empty parameter group, and ZeRO 1 gives a rank an empty group
    # when it owns none of that group's parameters: load around them, then put them back in place
    groups = local.param_groups
    local.param_groups = [g for g in groups if g["params"]]
    try:
        set_optimizer_state_dict(model, local, state["optim"], options=FLAT_OPTIM)
    finally:
        loaded = iter(local.param_groups)
        local.param_groups = [next(loaded) if g["params"] else g for g in groups]


def capture_rng() -> dict:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(mt), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
           "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def write_json(path: Path, obj) -> None:
    """Write through a temporary file and a rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    tmp.replace(path)


_REQUIRED = object()


def read_json(path: Path, default=_REQUIRED):
    """The file's JSON; `default` instead when it is missing or unreadable, if one is given."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if default is _REQUIRED:
            raise
        return default


def saved_config(train_state: dict, where: str) -> Config:
    """The validated config a checkpoint was written with."""
    return validate_config(tomllib.loads(train_state["config"]), origin=where)

"""The tensors of a checkpoint (model and optimizer state), through torch.distributed.checkpoint:
sharded on save and resharded on load for any world size or layout. Everything else a checkpoint
holds is small JSON (train_state.py).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _flatten_optim_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# The optimizer state is stored flat, one key per parameter ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"): no list whose length depends on the layout (a ZeRO 1 rank's groups hold
# only its own parameters), so any layout loads any other's checkpoint.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, with_model: bool = True) -> dict:
    """The DCP state dict: fully-qualified names, independent of DDP/compile/checkpoint wrappers and of
    the layout (FSDP2 gives DTensor shards; under ZeRO 1 each rank gives the state it holds, and the
    union over ranks is the state of the unsharded optimizer). DCP reshards between layouts on load.
    `optimizer`: the one whose state this rank holds (ZeRO 1: the shard's inner optimizer); None when it
    holds none (a parameter-server worker: the servers hold it). `with_model` False: the optimizer state
    only (a parameter server saves the state of its tensors; the workers save the parameters)."""
    out = {"model": get_model_state_dict(model)} if with_model else {}
    if optimizer is not None:
        out["optim"] = get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIM)
    return out


class TensorStateCache:
    """tensor_state(), reused between saves (as torchtitan does for the model). Its tensors ARE the live
    parameters, buffers and optimizer moments, updated in place by training, so only the optimizer's
    hyperparameters (the scheduled learning rate) need refreshing; it is rebuilt whenever one of those
    tensors was replaced (a load, the optimizer's first step). Building it costs ~10 ms per save for a
    small model: most of an async save's stall."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer
        self._key: tuple[int, ...] | None = None
        self._state: dict | None = None

    def _identity(self) -> tuple[int, ...] | None:
        ids = [id(t) for t in self.model.parameters()] + [id(t) for t in self.model.buffers()]
        for per_param in (self.optimizer.state.values() if self.optimizer is not None else ()):
            if not all(isinstance(v, torch.Tensor) for v in per_param.values()):
                return None  # a plain number in the state is copied, not shared: never reuse
            ids += [id(v) for v in per_param.values()]
        return tuple(ids)

    def get(self) -> dict:
        key = self._identity()
        if self.optimizer is None:  # a parameter-server worker: the servers save the optimizer state
            return {"model": get_model_state_dict(self.model)}
        if key is None or key != self._key or self._state is None:
            # nested optimizer state here (its groups can be refreshed in place), flattened per save
            self._state = {"model": get_model_state_dict(self.model),
                           "optim": get_optimizer_state_dict(self.model, self.optimizer)}
            self._key = key
        else:
            for saved, live in zip(self._state["optim"]["param_groups"], self.optimizer.param_groups, strict=True):
                saved.update((k, v) for k, v in live.items() if k != "params")
        # torch's own flattening (what set_optimizer_state_dict(options=FLAT_OPTIM) reads back); it pops
        # each group's "params", so it gets copies of the groups
        optim = self._state["optim"]
        groups = [dict(g) for g in optim["param_groups"]]
        flat = _flatten_optim_state_dict({"state": optim["state"], "param_groups": groups})
        return {"model": self._state["model"], "optim": flat}


def apply_tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    """Load `state` (tensor_state's layout, filled by DCP) into the live model and optimizer."""
    set_model_state_dict(model, state["model"])
    if optimizer is None:
        return
    # torch cannot load flat state into an empty parameter group, and ZeRO 1 gives a rank an empty group
    # when it owns none of that group's parameters: load around them, then put them back in place
    groups = optimizer.param_groups
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=FLAT_OPTIM)
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


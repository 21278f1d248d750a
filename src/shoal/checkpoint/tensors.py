"""The tensors of a checkpoint (model and optimizer state), through torch.distributed.checkpoint:
sharded on save and resharded on load for any world size or layout. Everything else a checkpoint
holds is small JSON (train_state.py).
"""

from __future__ import annotations

import re

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _flatten_optim_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

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
    if copy_tensor_state(model, optimizer, state):
        return
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


_WRAPPED = re.compile(r"_checkpoint_wrapped_module\.|_orig_mod\.")


def original_name(name: str) -> str:
    """A parameter's name in the model as built, from its name in the laid-out one: activation
    checkpointing and torch.compile insert a wrapper's name into it."""
    return _WRAPPED.sub("", name)


def copy_tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict) -> bool:
    """apply_tensor_state for a rank that holds the whole model and its optimizer's whole state as plain
    tensors (a replicated layout: DDP and its sync modes), by copying. On a live run's regroup this is on
    every survivor's path back to training, and DCP's general loader costs ~14 ms for gpt-tiny with AdamW
    where this takes ~1.5 (DCP steps the optimizer once to create its state, and maps every name through
    the wrappers several times; benchmarks/restore.py). Returns False, having changed nothing, unless
    `state` names exactly this rank's tensors with their shapes and dtypes (then apply_tensor_state's
    general path loads it, resharding as needed)."""
    live = {original_name(k): v for k, v in model.state_dict(keep_vars=True).items()}
    saved = state["model"]
    if live.keys() != saved.keys() or not all(_same(v, saved[k]) for k, v in live.items()):
        return False
    per_param = None
    if optimizer is not None:
        per_param = _optimizer_state(model, optimizer, state["optim"])
        if per_param is None:
            return False
    with torch.no_grad():
        for k, v in live.items():
            v.copy_(saved[k])
    for group in optimizer.param_groups if optimizer is not None else ():
        for p in group["params"]:
            values, tensors = per_param[id(p)]
            group.update(values)  # the same for every parameter of the group (checked)
            if tensors:  # the saved tensors themselves, as Optimizer.load_state_dict keeps them
                optimizer.state[p] = dict(tensors)
            else:
                optimizer.state.pop(p, None)
    return True


def _same(live, saved) -> bool:
    return (type(live) in (torch.Tensor, torch.nn.Parameter) and isinstance(saved, torch.Tensor)
            and not isinstance(saved, DTensor) and live.shape == saved.shape and live.dtype == saved.dtype)


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: dict) -> dict | None:
    """{id(parameter): (its group's saved values, its saved state tensors)} from the flat optimizer state
    (keys "state.<name>.<item>" and "param_groups.<name>.<item>"), or None unless it holds exactly this
    optimizer's parameters, each group's values alike, the same state items for every parameter, each
    shaped like its parameter or a scalar."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters():  # a shared parameter's first name, as DCP flattens it
        names.setdefault(id(p), original_name(n))
    by_name: dict[str, tuple[dict, dict]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        name, _, item = rest.rpartition(".")
        values, tensors = by_name.setdefault(name, ({}, {}))
        if kind == "param_groups":
            values[item] = value
        elif kind == "state" and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            tensors[item] = value
        else:
            return None
    if len({frozenset(tensors) for _, tensors in by_name.values()}) > 1:  # a parameter's state incomplete
        return None
    out = {}
    for group in optimizer.param_groups:
        first = None
        for p in group["params"]:
            name = names.get(id(p))
            if name not in by_name:
                return None
            values, tensors = by_name[name]
            first = values if first is None else first
            if values != first or any(t.dim() and (t.shape != p.shape or t.dtype != p.dtype) for t in tensors.values()):
                return None
            out[id(p)] = values, tensors
    held = {names[i] for i in out}
    return out if held == by_name.keys() else None

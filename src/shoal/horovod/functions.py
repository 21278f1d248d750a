"""Horovod's helpers over the collectives: broadcasting a model's parameters and an optimizer's state
from one process, and Python objects between processes.

An optimizer's state is broadcast as root's state_dict: its structure (numbers, strings, the
parameter groups' settings, where each tensor goes) as one object, then its tensors each by a
broadcast, then loaded on the other processes. Horovod instead steps a fresh optimizer once on zero
gradients to create the state it then overwrites, which moves parameters when weight decay is on;
loading root's state needs no step, and every process ends with root's state exactly, an empty one
included.

Objects travel pickled (torch's broadcast_object_list and all_gather_object), between the
processes of one job, as Horovod's own functions send them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.errors import UserError
from shoal.horovod import runtime
from shoal.horovod.gather import broadcast_async_
from shoal.horovod.handles import synchronize
from shoal.horovod.process_sets import global_process_set, whole


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite every process's tensors with root_rank's: a state_dict (by sorted name), or a list or
    iterable of parameters or (name, parameter) pairs (model.parameters(), model.named_parameters())."""
    if isinstance(params, dict):
        pairs = sorted(params.items())
    elif hasattr(params, "__iter__"):
        pairs = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise UserError(f"hvd.broadcast_parameters: params of type {type(params).__name__}; give model.state_dict() "
                        f"or model.named_parameters()")
    handles = [broadcast_async_(p.detach(), root_rank, name) for name, p in pairs]  # detach: the same storage
    for h in handles:
        synchronize(h)


@dataclass(frozen=True)
class Slot:
    """Where a tensor of the optimizer's state goes: its place in the broadcast order, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _carve(x, tensors: list[torch.Tensor]):
    """`x` (a state_dict) with each tensor replaced by its Slot, the tensors appended to `tensors`."""
    if isinstance(x, torch.Tensor):
        tensors.append(x.detach().contiguous())
        return Slot(len(tensors) - 1, tuple(x.shape), x.dtype)
    if isinstance(x, dict):
        return {k: _carve(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_carve(v, tensors) for v in x)
    return x


def _fill(x, tensors: list[torch.Tensor]):
    if isinstance(x, Slot):
        return tensors[x.index]
    if isinstance(x, dict):
        return {k: _fill(v, tensors) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_fill(v, tensors) for v in x)
    return x


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Every process's optimizer gets root_rank's state and settings (learning rates, momenta, ...)."""
    rt = runtime.runtime()
    if rt.place.size == 1:
        return
    tensors: list[torch.Tensor] = []
    skeleton = broadcast_object(_carve(optimizer.state_dict(), tensors), root_rank, "optimizer state")
    if rt.place.rank != root_rank:
        slots = sorted(_slots(skeleton), key=lambda s: s.index)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    handles = [broadcast_async_(t, root_rank, f"optimizer state {i}") for i, t in enumerate(tensors)]
    for h in handles:
        synchronize(h)
    if rt.place.rank != root_rank:
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _slots(x) -> list[Slot]:
    if isinstance(x, Slot):
        return [x]
    if isinstance(x, dict):
        return [s for v in x.values() for s in _slots(v)]
    if isinstance(x, (list, tuple)):
        return [s for v in x for s in _slots(v)]
    return []


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """root_rank's `obj`, on every process."""
    whole(process_set)
    rt = runtime.runtime()
    if rt.place.size == 1:
        return obj
    return rt.comm.broadcast_objects(obj, root_rank, f"hvd.broadcast_object {name or type(obj).__name__}")


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every process's `obj`, in rank order."""
    whole(process_set)
    rt = runtime.runtime()
    if rt.place.size == 1:
        return [obj]
    return rt.comm.all_gather_objects(obj, f"hvd.allgather_object {name or type(obj).__name__}")

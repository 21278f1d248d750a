"""A rank's share of a model laid out on the meta device, made real: allocated on the device, then each
tensor filled with this rank's part of the value one process would give it (models/deferred.py replays
the build), so no rank ever holds the whole model.

  fresh start  every parameter and buffer this rank holds, from the replayed build (seeded init, and the
               files of model.init_from read tensor by tensor)
  resume       only what a checkpoint does not hold (non-persistent buffers, tensors a module keeps as a
               plain attribute); the parameters stay uninitialised until the checkpoint loads into them

A DTensor's part is taken from the whole value by DTensor's own redistribution from a replicated tensor
(Replicate -> Shard slices locally; no communication), so tensor-parallel, ZeRO 3 and 2-D placements are
cut exactly as the layouts cut them when they were given a whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from shoal.models.deferred import Deferred, Ref, Sink, replay
from shoal.models.meta import materialize as allocate

# what the wrappers put into parameter names: activation checkpointing, torch.compile, DDP
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "module"})


def original_name(name: str) -> str:
    """A parameter's name in the model as built, from its name inside the wrappers."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


@dataclass
class Materializer:
    """Fills a laid-out model once (`fill`); later calls do nothing, as does every call for a model that was
    built whole (`deferred` None)."""

    deferred: Deferred | None
    device: torch.device
    done: bool = False
    whole_bytes: int = 0

    def fill(self, root: torch.nn.Module) -> None:
        """Allocate `root`'s meta tensors on the device and fill them (collective-free: every rank replays
        the same build and keeps its own part). `whole_bytes`: the most the replay held whole at once."""
        if self.done or self.deferred is None:
            return
        self.done = True
        allocate(root, self.device, keep_real=True)  # a tensor a layout made on its own keeps its value
        wanted: dict[Ref, list[Sink]] = {}
        names = self.deferred.names
        for name, t in _named_tensors(root):
            key = original_name(name)
            if key not in names or (not self.deferred.fresh and key not in self.deferred.transient):
                continue
            wanted.setdefault(names[key], []).append(_copy_share(t))
        for module in root.modules():  # tensors kept as plain attributes (a rotary embedding's original table)
            for attr, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_meta:
                    ref = self.deferred.recording.ref(value)
                    wanted.setdefault(ref, []).append(_set_attribute(module, attr, self.device))
        self.whole_bytes = replay(self.deferred.recording, wanted, draws=self.deferred.fresh)


def _named_tensors(root: torch.nn.Module):
    yield from root.named_parameters(remove_duplicate=False)
    yield from root.named_buffers(remove_duplicate=False)


def _copy_share(target: torch.Tensor) -> Sink:
    """A sink that copies this rank's part of the whole value into `target` (its local shard, in place)."""

    def sink(value: torch.Tensor) -> None:
        with torch.no_grad():
            if isinstance(target, DTensor):
                mesh = target.device_mesh
                whole = DTensor.from_local(value.to(target.device), mesh, [Replicate()] * mesh.ndim, run_check=False)
                target._local_tensor.copy_(whole.redistribute(mesh, target.placements).to_local())
            else:
                target.copy_(value)

    return sink


def _set_attribute(module: torch.nn.Module, attr: str, device: torch.device) -> Sink:
    return lambda value: setattr(module, attr, value.to(device, copy=True))


def whole(bundle, device: torch.device) -> torch.nn.Module:
    """`bundle.model` whole on `device` (a way of training that holds every weight on each rank): a deferred
    one filled from its record."""
    if bundle.deferred is None:
        return bundle.model.to(device)
    Materializer(bundle.deferred, device).fill(bundle.model)
    return bundle.model

"""Build a model without computing its weights: on the meta device, then memory allocated but not
initialized. Used when the weights are about to come from a checkpoint anyway (a resume pays neither
the random init of every parameter nor, on the meta device, torch's import of its compiler stack),
and by the start-time checks, which only need shapes.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# nn.init functions and the in-place samplers behind them: on a meta tensor they would only fetch
# torch's python decompositions (and import torch._dynamo, ~1 s) to compute nothing
_INIT_OPS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                       "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "constant_",
                       "ones_", "zeros_", "eye_", "dirac_", "fill_", "zero_"})


class _SkipInitOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_OPS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def on_meta():
    """Modules created inside have meta parameters (shapes only) and skip their init."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield


def has_transient_buffers(model: torch.nn.Module) -> bool:
    """Non-persistent buffers are not in a checkpoint: such a model must be initialized normally."""
    return any(m._non_persistent_buffers_set for m in model.modules())


def materialize(model: torch.nn.Module, device: torch.device | str, keep_real: bool = False) -> torch.nn.Module:
    """Allocate a meta model's tensors on `device` (uninitialized), keeping tied parameters tied:
    `to_empty` gives each module its own new tensor, which would untie, say, GPT's embedding and head.
    `keep_real`: tensors that are not on the meta device keep their values (moved to `device`)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners[id(p)].append((module, name))
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta or not keep_real else t.to(device))
    for places in owners.values():
        first_module, first_name = places[0]
        for module, name in places[1:]:
            setattr(module, name, first_module._parameters[first_name])
    return model


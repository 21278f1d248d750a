"""A user's model and optimizer as a Session prepares them: the optimizer's groups by parameter name, rebuilt
over the laid-out model; the forward under the config's autocast; the tensor-parallel plan; the description
`shoal plan --check` reads."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch

from shoal.checkpoint.tensors import original_name
from shoal.errors import UserError
from shoal.parallel.precision import Precision
from shoal.training.session_data import map_tensors


def named_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's parameter groups with the parameters' names in place of the parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    # a Keras model's parameters() also lists its frozen state (seed generators, moving statistics), which
    # its KerasModule holds as buffers: an optimizer given those has nothing to do with them (left out here,
    # so not in the rebuilt optimizer; the user's own is not changed)
    kept = [[p for p in g["params"] if id(p) in names or p.requires_grad] for g in optimizer.param_groups]
    if any(id(p) not in names for params in kept for p in params):
        raise UserError("sess.prepare(model, optimizer): the optimizer holds parameters that are not the model's; "
                        "give each model its own optimizer")
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in params]}
            for g, params in zip(optimizer.param_groups, kept, strict=True)]


def rebuilt(optimizer: torch.optim.Optimizer, groups: list[dict], par) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class over the laid-out model's parameters, group by group (ZeRO 1:
    sharded, as shoal train's)."""
    params = {original_name(n): p for n, p in par.model.named_parameters()}
    groups = [{**g, "params": [params[n] for n in g["params"]]} for g in groups]
    # every group carries all its hyperparameters; the defaults only as far as the constructor takes them
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return par.build_optimizer(groups, type(optimizer), **defaults)


def autocast_forward(forward: Callable, precision: Precision) -> Callable:
    """The prepared model's forward under autocast, its bf16 or fp16 outputs handed back in fp32, as Accelerate's
    prepare() does: the user's loss runs outside autocast, where a low-precision output against an fp32 target
    fails (mse_loss's backward on CUDA: "Found dtype Float but expected BFloat16") or loses precision."""
    def run(*args, **kwargs):
        with precision.autocast():
            return in_fp32(forward(*args, **kwargs))

    return run


def in_fp32(out):
    """`out` (a tensor, or tuples, lists and dicts of them, as Hugging Face's ModelOutput) with every bf16 or fp16
    tensor cast to fp32."""
    return map_tensors(out, lambda t: t.float() if t.dtype in (torch.bfloat16, torch.float16) else t)


def tensor_parallel_of(model: torch.nn.Module, plan: Mapping[str, object] | None):
    """The ModelBundle.tensor_parallel for a prepared model: the user's plan, else a Hugging Face model's
    declared one, else None (the model cannot be split)."""
    from shoal.models import hf
    from shoal.models.tp_plan import tensor_parallel_by_plan

    if plan is not None:
        return tensor_parallel_by_plan(plan)
    return hf.tensor_parallel if hasattr(model, "config") and hf.tp_plan(model) else None


def described(model: torch.nn.Module, blocks: tuple[type, ...], optimizer: torch.optim.Optimizer) -> dict:
    """A prepared model as `shoal plan --check` reads it (plan/check.py): each parameter as (numel, first
    dimension, ndim, trainable), tied ones once, also per block, and its optimizer's class and momentum."""

    def params(m: torch.nn.Module) -> list[list]:
        return [[p.numel(), p.shape[0] if p.dim() else 1, p.dim(), p.requires_grad] for p in m.parameters()]

    return {"class": type(model).__name__, "params": params(model),
            "blocks": [params(m) for m in model.modules() if blocks and isinstance(m, blocks)],
            "optimizer": type(optimizer).__name__, "momentum": float(optimizer.defaults.get("momentum", 0.0) or 0.0)}


def loss_in_your_loop(model, batch):
    raise AssertionError("a Session's loss is computed by the user's loop")

"""Model registry: `model.name` is a built-in name or "package.module:function" for a user model.

A builder takes (model config section, DataSpec) and returns a ModelBundle: the module, its loss
function, and optionally an evaluation function for extra validation metrics.

[Note: loss contract] `loss_fn(model, batch) -> loss_sum` returns the loss SUMMED over the items of
the batch (tokens, samples), and `count_fn(batch)` says how many items that sum covers, computed from
the batch alone so it is known before the forward pass. The training loop scales each micro-batch's
backward by dp / (items in the whole global batch), so accumulation and data parallelism give the
gradient of one big batch's mean loss, whatever the split (torch DDP averages over dp ranks).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from shoal.errors import UserError

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]
EvalFn = Callable[[torch.nn.Module, Batch], dict[str, tuple[torch.Tensor, torch.Tensor]]]


def count_samples(batch: Batch) -> torch.Tensor:
    """Default item count: samples (the leading dimension of the batch's tensors)."""
    return torch.tensor(len(next(iter(batch.values()))))


@dataclass(frozen=True)
class DataSpec:
    """What a data source tells the model builder: sizes that must agree on both sides."""

    kind: str  # "tokens" | "images" | "interactions"
    vocab_size: int | None = None  # tokens
    num_classes: int | None = None  # images
    image_size: int | None = None  # images
    num_users: int | None = None  # interactions
    num_items: int | None = None  # interactions


@dataclass
class ModelBundle:
    model: torch.nn.Module
    loss_fn: LossFn
    count_fn: Callable[[Batch], torch.Tensor] = count_samples
    # eval_fn(model, batch) -> {metric: (sum, count)} on validation batches; default: {"loss": ...}
    eval_fn: EvalFn | None = None
    # module types wrapped by activation checkpointing (transformer blocks, residual blocks)
    block_types: tuple[type, ...] = ()
    items_name: str = "samples"  # what loss_fn counts: "tokens" or "samples"
    # tensor parallelism: tp_plan(model, tp_mesh, model_cfg) splits the model in place and returns the
    # context that loss_fn and its backward run in (e.g. loss_parallel for a vocab-sharded output);
    # it raises UserError when the degree does not fit the model. None: the model has no plan.
    tp_plan: Callable[..., Any] | None = None
    loss_context: Callable[[], Any] = contextlib.nullcontext  # set by parallelize() from the tp plan
    # pipeline parallelism: pp_plan(model) -> (layer names, per-layer costs, build_stage(first, last),
    # output_loss(output, target) -> loss sum over items whose target is not -1). None: no plan.
    pp_plan: Callable[..., Any] | None = None


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)
    data_kinds: ClassVar[tuple[str, ...] | None] = None  # data kinds it can train on; None: any


class UserModelConfig(ModelSection):
    """`name = "pkg.mod:fn"`; every other key in [model] is passed through to the user's builder."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    seq_len: int | None = None  # needed when a user model trains on a text/token source


def _builtins() -> dict[str, tuple[type[ModelSection], Callable[..., ModelBundle]]]:
    from shoal.models import gpt, ncf, resnet

    return {"gpt": (gpt.GPTConfig, gpt.build), "resnet": (resnet.ResNetConfig, resnet.build),
            "ncf": (ncf.NCFConfig, ncf.build)}


def builtin_model_configs() -> dict[str, type[ModelSection]]:
    return {name: cls for name, (cls, _) in _builtins().items()}


def model_config_class(name: Any) -> type[ModelSection]:
    builtins = _builtins()
    if not isinstance(name, str):
        raise UserError(f"model.name = {name!r} must be a string")
    if name in builtins:
        return builtins[name][0]
    if ":" in name:
        _import_user_builder(name)
        return UserModelConfig
    raise UserError(
        f'unknown model.name = "{name}"; use one of {", ".join(builtins)} or "package.module:function"'
    )


def build_model(cfg: ModelSection, spec: DataSpec) -> ModelBundle:
    builtins = _builtins()
    builder = builtins[cfg.name][1] if cfg.name in builtins else _import_user_builder(cfg.name)
    bundle = builder(cfg, spec)
    if isinstance(bundle, tuple):  # user models may return (model, loss_fn)
        bundle = ModelBundle(*bundle)
    if bundle.eval_fn is None:
        loss_fn, count_fn = bundle.loss_fn, bundle.count_fn
        bundle.eval_fn = lambda model, batch: {"loss": (loss_fn(model, batch), count_fn(batch))}
    return bundle


def _import_user_builder(name: str) -> Callable[..., Any]:
    module_name, _, func_name = name.partition(":")
    # like `python -m`, let a user model live in the current directory
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f'model.name = "{name}": cannot import {module_name} ({e}); check PYTHONPATH') from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise UserError(f'model.name = "{name}": {module_name} has no function {func_name}')
    return fn


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

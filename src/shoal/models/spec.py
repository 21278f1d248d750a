"""The model contract: what a model builder returns and what every batch looks like.

A builder takes (model config section, DataSpec) and returns a ModelBundle: the module, its loss
function, and optionally an evaluation function, the blocks to shard or checkpoint, and the
functions that split it for tensor and pipeline parallelism. This module holds only types; the
name -> builder table is models/registry.py.

[Note: loss contract] `loss_fn(model, batch) -> loss_sum` returns the loss SUMMED over the items of
the batch (tokens, samples), and `count_fn(batch)` says how many items that sum covers, computed from
the batch alone so it is known before the forward pass. The training loop scales each micro-batch's
backward by dp / (items in the whole global batch), so accumulation and data parallelism give the
gradient of one big batch's mean loss, whatever the split (gradient all-reduces average over dp ranks).

[Note: batch formats] A batch is a dict of tensors whose first dimension is the sample. What each
data kind delivers (data/sources.py):
  tokens        {"input": (B, T) int64, "target": (B, T) int64}: target is input shifted by one;
                a target of -1 is not counted (count_fn, loss) and pads short batches
  images        {"image": (B, 3, H, W) float32, "label": (B,) int64}
  interactions  training {"user": (B,) int64, "item": (B,) int64, "label": (B,) float32 0/1};
                validation {"user": (B,) int64, "candidates": (B, 100) int64}, candidate 0 the
                held-out positive
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # torch is not imported here: the config (model sections) is read before torch, at a command's start
    import torch

Batch = dict[str, "torch.Tensor"]
LossFn = Callable[["torch.nn.Module", Batch], "torch.Tensor"]
EvalFn = Callable[["torch.nn.Module", Batch], dict[str, tuple["torch.Tensor", "torch.Tensor"]]]
LossContext = Callable[[], contextlib.AbstractContextManager]


def count_samples(batch: Batch) -> torch.Tensor:
    """Default item count: samples (the leading dimension of the batch's tensors)."""
    import torch

    return torch.tensor(len(next(iter(batch.values()))))


@dataclass(frozen=True)
class DataSpec:
    """What a data source tells the model builder: sizes that must agree on both sides."""

    kind: str  # "tokens" | "images" | "interactions" (see [Note: batch formats])
    vocab_size: int | None = None  # tokens
    num_classes: int | None = None  # images
    image_size: int | None = None  # images
    num_users: int | None = None  # interactions
    num_items: int | None = None  # interactions


@dataclass(frozen=True)
class UserData:
    """What a user's data function (data.source = "package.module:function", called with the [data]
    config section) may return instead of a bare map-style dataset: the training set, optionally a
    validation set (else the last data.val_fraction of `train` is held out), a collate function (a
    list of samples -> a Batch; default: each key's tensors stacked) and the DataSpec the model builder
    needs (default: kind "custom", no sizes). A dataset is anything with len() and [i] -> a dict of
    tensors, such as a torch Dataset."""

    train: object
    val: object | None = None
    collate: Callable[[list[Batch]], Batch] | None = None
    spec: DataSpec | None = None


class PipelineLayers(NamedTuple):
    """A model seen as a sequence of layers, for pipeline parallelism."""

    names: list[str]  # one per layer, for the printed split ("embeddings", "blocks.0", ...)
    costs: list[float]  # per layer, what the automatic split balances (e.g. forward FLOPs)
    # build_stage(first, last): a module holding layers [first, last), its parameters under the whole
    # model's names so that checkpoints load across layouts; it maps the previous stage's output (the
    # batch's "input" for the first stage) to its own
    build_stage: Callable[[int, int], torch.nn.Module]
    # output_loss(last stage's output, target): the loss summed over items whose target is not -1
    output_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # losses the layers add on every stage (models/moe.py CarriedLosses: start(scale) before a step's schedule,
    # taken(device) after it, their sum), or None
    carried: object | None = None


@dataclass
class ModelBundle:
    model: torch.nn.Module
    loss_fn: LossFn
    count_fn: Callable[[Batch], torch.Tensor] = count_samples
    # eval_fn(model, batch) -> {metric: (sum, count)} on validation batches; default: {"loss": ...}
    eval_fn: EvalFn | None = None
    # module types that are units of sharding (ZeRO 2/3) and of activation checkpointing
    block_types: tuple[type, ...] = ()
    items_name: str = "samples"  # what loss_fn counts: "tokens" or "samples"
    # tensor_parallel(model, tp, mesh=None, sequence_parallel=False): raises UserError when `tp` does
    # not fit the model; given the tp DeviceMesh, splits the model in place and returns the context
    # loss_fn and its backward run in (loss_parallel for a vocab-sharded output), or None for none.
    # None here: the model cannot be split by tensor parallelism.
    tensor_parallel: Callable[..., LossContext | None] | None = None
    # pipeline(model) -> PipelineLayers. None: the model cannot be split into pipeline stages.
    pipeline: Callable[[torch.nn.Module], PipelineLayers] | None = None
    # training FLOPs (forward + backward) of one sample, by the model's own count, for MFU; None: counted
    # by torch's FlopCounterMode over one micro-batch on the meta device (metrics/profile.py)
    flops_per_sample: float | None = None
    # its weights are uninitialised memory that a checkpoint or a live peer fills after the wrap: DDP's
    # initial broadcast of rank 0's weights would send nothing of use
    uninitialised: bool = False
    # the model is on the meta device, its values a record of its build (models/deferred.py, a Deferred):
    # the layouts apply to it as it is, and each rank then fills only its share (parallel/materialize.py)
    deferred: object | None = None
    # why the model was built whole on every rank although a record was tried (training/build.py): its build
    # does something a record on the meta device cannot replay exactly. None: recorded, or never tried
    built_whole: str | None = None
    # tp_split(model) -> the parameters tensor_parallel splits over the tp ranks (the rest are whole on every
    # one), from the same plan it applies (tp_plan.split_by): what `shoal plan` and the preflight count each
    # rank's model state by. None: every matrix (ndim >= 2) is counted as split.
    tp_split: Callable[[torch.nn.Module], list[torch.nn.Parameter]] | None = None
    # loss_fn only calls the model, which takes its loss in its own forward (shoal's GPT): the compiled model
    # compiles the loss, and train.compile leaves loss_fn as it is (parallel/apply.py with_compiled_loss)
    loss_in_forward: bool = False
    # the parameters one token (or sample) passes through, where fewer than all: a mixture of experts' (the dense
    # part and top_k of each layer's experts); None: all of them
    active_params: int | None = None
    # parallel.cp can split its sequences: loss_fn gives the model a batch's "positions" (each token's place in its
    # sequence, a rank's part of it) and its attention is F.scaled_dot_product_attention, causal (parallel/context.py)
    takes_positions: bool = False

    def params_text(self, total: int) -> str:
        """`total` parameters as `shoal train`'s first line and `shoal plan` say them, with a mixture of experts'
        active ones."""
        active = f", {self.active_params:,} active per token" if self.active_params is not None else ""
        return f"{total:,} parameters{active}"


class ModelSection(BaseModel):
    """Base of a model's [model] config section (pydantic, strict, frozen)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)
    data_kinds: ClassVar[tuple[str, ...] | None] = None  # data kinds it can train on; None: any
    init_from: str | None = None
    """Initial weights of a fresh start (a resume still wins): a .safetensors file (`shoal export` writes
    one) or a Hugging Face directory. Names and shapes must match the model exactly (models/pretrained.py)."""

    def initial_weights(self) -> str | None:
        """Where a fresh start's weights come from; None: the seeded random init."""
        return self.init_from

    def routed_experts(self) -> tuple[int, str] | None:
        """A mixture of experts' routed experts per layer and the key that sets them (what parallel.ep splits);
        None: a model without experts."""
        return None


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

"""A tensor-parallel plan as users declare one: module name or pattern -> how it is split, in the words
of transformers' `base_model_tp_plan` ("colwise", "rowwise", ...) or as DTensor's own ParallelStyle
objects (ColwiseParallel(), RowwiseParallel(...), what torch's tensor-parallel tutorial and torchtitan
pass to `parallelize_module`). Hugging Face models (hf.py) and models given to a Session with
`tp_plan=` (training/session.py) are split through it; shoal's GPT has its own (gpt_parallel.py).

A plan splits the named layers' weights; the code around them is the model's. The usual case: column-
parallel projections followed by a row-parallel one, as in attention (q, k, v then the output) and
MLPs (up then down), whose result is whole again on every tp rank. Code that reshapes a split layer's
output by a head count must use the local one (or -1), as in torch's tutorial.

A layer that trains in float8 (precision.dtype = "fp8": parallel/float8.py made it torchao's Float8Linear
before the split) is split by torchao's float8 style of the same layouts (float8_styles), as torchtitan's
apply_tp does: its input and its output gradient are cast to float8 on the DTensor, with one scale for the
whole tensor across the tp ranks, so that a sequence-parallel gather moves float8 bytes.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Mapping

from torch import nn

from shoal.errors import UserError

NAMES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def style(name: str, how):
    """DTensor's ParallelStyle for the plan's entry `name: how` (a ParallelStyle passes through)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(how, ParallelStyle):
        return how
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate())}
    if how not in styles:
        raise UserError(f"the tensor-parallel plan splits {name} as {how!r}, which shoal does not translate (it knows "
                        f"{', '.join(NAMES)}, or a torch.distributed.tensor.parallel style); set parallel.tp = 1")
    return styles[how]()


def refuse_sequence_parallel(asked: bool) -> None:
    """Sequence parallelism needs the model's norms and dropout split by sequence, which only shoal's GPT
    does (gpt_parallel.py): a plan splits layers' weights, not the activations between them."""
    if asked:
        raise UserError('parallel.sequence_parallel is offered for model.name = "gpt" only; set it to false')


def resolve(model: nn.Module, plan: Mapping[str, object], tp: int, *, strict: bool) -> dict[str, object]:
    """The plan as {module name: ParallelStyle} over `model`'s modules (fnmatch patterns expanded), after
    checking that tp divides what each style splits. `strict`: a pattern that names no module is an error
    (a user's own plan: a typo would silently leave a layer whole); a declared plan may name layers a
    smaller variant of the model does not have."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    styles = {}
    for pattern, how in plan.items():
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if strict and not matched:
            some = ", ".join(list(n for n in modules if n)[:6])
            raise UserError(f"tp_plan[{pattern!r}] names no module of the model (its modules: {some}, ...); name a "
                            f"module by its path, e.g. 'blocks.*.attn.q'")
        for name in matched:
            styles[name] = s = style(name, how)
            module = modules[name]
            dim = None
            if isinstance(module, nn.Linear):
                dim = {ColwiseParallel: ("out_features", module.out_features),
                       RowwiseParallel: ("in_features", module.in_features)}.get(type(s))
            elif isinstance(module, nn.Embedding):
                dim = {ColwiseParallel: ("embedding_dim", module.embedding_dim),
                       RowwiseParallel: ("num_embeddings", module.num_embeddings)}.get(type(s))
            if dim is not None and dim[1] % tp:
                raise UserError(f"parallel.tp ({tp}) must divide {name}'s {dim[0]} ({dim[1]}), which the plan splits; "
                                f"choose a tp that divides it")
    return styles


def split_by(model: nn.Module, styles: Mapping[str, object]) -> list[nn.Parameter]:
    """The parameters that `styles` ({module name: ParallelStyle}, as parallelize_module takes them) split
    over the tp ranks, as DTensor's styles place them: a column- or row-parallel layer's weight, and a
    column-parallel linear layer's bias; a row-parallel layer's bias, and every parameter of a module the
    styles leave out or only reshard the activations of (SequenceParallel, PrepareModuleInput / Output),
    are whole on every tp rank. What `shoal plan` and the preflight count each rank's model state by."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules, out, seen = dict(model.named_modules()), [], set()
    for name, s in styles.items():
        if not isinstance(s, (ColwiseParallel, RowwiseParallel)):
            continue
        for key, p in modules[name].named_parameters(recurse=False):
            if (key == "weight" or isinstance(s, ColwiseParallel)) and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def split_parameters(bundle) -> list[nn.Parameter] | None:
    """The parameters the bundle's tensor parallelism splits over the tp ranks, from the model's own plan
    (ModelBundle.tp_split); None where the bundle does not say (every matrix is taken as split): the one
    answer `shoal plan` (the model's state and its trace) and the preflight's memory check count by."""
    if bundle.tensor_parallel is None or bundle.tp_split is None:
        return None
    return list(bundle.tp_split(bundle.model))


def parallelize(model: nn.Module, mesh, styles: Mapping[str, object]) -> None:
    """parallelize_module over the tp `mesh`, a layer that trains in float8 split by its float8 style."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module

    # gloo has no float8 type ("Invalid scalar type"); NCCL gathers float8 as bytes
    carries_float8 = "nccl" in dist.get_backend(mesh.get_group())
    parallelize_module(model, mesh, float8_styles(model, styles, carries_float8))


def float8_styles(model: nn.Module, styles: Mapping[str, object], carries_float8: bool) -> dict[str, object]:
    """`styles` with torchao's float8 style of the same layouts for each column- or row-parallel layer that is a
    Float8Linear with tensorwise scales (the float8 styles cast with one scale per tensor; a rowwise layer keeps
    DTensor's style and casts its own operands, as in torchtitan), and PrepareFloat8ModuleInput for a
    PrepareModuleInput over a module whose linear layers all are (it casts the module's input once, before the
    gather: an attention or MLP block, which hands its input to those layers only).
    `carries_float8`: the tp group's backend can move float8 tensors; where it cannot (gloo) a layer keeps the
    plain style unless its float8 style moves nothing in float8: layouts that need no resharding."""
    if "torchao.float8.float8_linear" not in sys.modules:  # torchao never imported: no layer was converted
        return dict(styles)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    # DTensor's style -> (torchao's float8 style, the input and output layouts with which it reshards nothing)
    swaps = {ColwiseParallel: (Float8ColwiseParallel, ((Replicate(),), (Shard(-1),))),
             RowwiseParallel: (Float8RowwiseParallel, ((Shard(-1),), (Replicate(),)))}
    modules, out = dict(model.named_modules()), {}
    for name, s in styles.items():
        m = modules.get(name)
        if type(s) in swaps and _tensorwise_float8(m):
            style, local = swaps[type(s)]
            if carries_float8 or (s.input_layouts, s.output_layouts) == local:
                s = style(input_layouts=s.input_layouts[0], output_layouts=s.output_layouts[0],
                          use_local_output=s.use_local_output)
        elif type(s) is PrepareModuleInput and carries_float8 and m is not None:
            layers = [c for c in m.modules() if isinstance(c, nn.Linear)]
            if layers and all(_tensorwise_float8(c) for c in layers):
                s = PrepareFloat8ModuleInput(input_layouts=s.input_layouts,
                                             desired_input_layouts=s.desired_input_layouts,
                                             input_kwarg_layouts=s.input_kwarg_layouts or None,
                                             desired_input_kwarg_layouts=s.desired_input_kwarg_layouts or None,
                                             use_local_output=s.use_local_output)
        out[name] = s
    return out


def _tensorwise_float8(module) -> bool:
    """A torchao Float8Linear that scales its input, weight and output gradient by one scale per tensor."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    c = module.config
    return all(cast.scaling_granularity is ScalingGranularity.TENSORWISE
               for cast in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output))


def tensor_parallel_by_plan(plan: Mapping[str, object]):
    """A ModelBundle.tensor_parallel that splits a model by a user's `plan` (see the module docstring)."""

    def tensor_parallel(model: nn.Module, tp: int, mesh=None, sequence_parallel: bool = False):
        refuse_sequence_parallel(sequence_parallel)
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
            raise UserError("a model with dropout under parallel.tp > 1 is not supported (dropout masks would "
                            "differ between tensor-parallel ranks); set its dropout to 0 or parallel.tp = 1")
        styles = resolve(model, plan, tp, strict=True)
        if mesh is not None:
            parallelize(model, mesh, styles)
        return None  # the plan's last layer gives whole outputs: the loss needs no context

    return tensor_parallel

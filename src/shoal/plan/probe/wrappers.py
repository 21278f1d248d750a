"""What torch's parallel wrappers cost on top of their arithmetic over the probe's group: an operator on a
DTensor, DDP, a tensor-parallel layer and FSDP2, each timed wrapped against bare, as a cost per operator, call,
parameter tensor, layer or byte."""

from __future__ import annotations

import contextlib
import statistics

import torch

from shoal.comm.collectives import Comm
from shoal.hardware import PROBE_LAYERS, line_through
from shoal.plan.probe.compute import _timed
from shoal.plan.probe.steps import REFERENCE_WIDTHS, _reference_bundle
from shoal.plan.reference import CPU_REFERENCE, Reference


def parallel_overheads(comm: Comm, device: torch.device, repeats: int, sync, widths=REFERENCE_WIDTHS,
                       least: tuple[int, int] = (40, 8), reference: Reference = CPU_REFERENCE) -> dict[str, float]:
    """What torch's parallel wrappers cost on top of their arithmetic, over the probe's group: stacks of 4
    and 32 tiny linear layers (8 and 64 parameter tensors, messages of ~1 KiB), forward and backward,
    wrapped against bare, fitted as a cost per call and per parameter tensor. A call's cost includes its
    tiny collective as it runs between layers (~1 ms here where the same collective alone takes 0.2-0.4):
    the planner adds only what a larger message costs beyond it (hardware.py's OVERHEAD_MESSAGE_BYTES).
      dtensor_op_s        one operator on a DTensor beyond the same operator on a plain tensor (Python
                          dispatch, sharding propagation): what the optimizer of a sharded layout pays
                          per operator;
      tp_layer_s          one linear layer split by tensor parallelism (column- and row-wise in turn):
                          DTensor's wrapping, sharding propagation and redistribution around it, and
                          its all-reduce (a row-wise layer's output in forward, a column-wise layer's
                          input gradient in backward);
      ddp_sync_s, ddp_local_s, ddp_param_s
                          DistributedDataParallel per micro-batch that all-reduces, per micro-batch that
                          only accumulates (no_sync), and per parameter tensor (its autograd hook);
      fsdp_call_s, fsdp_byte_s
                          FSDP2 per collective call and per byte it moves (fsdp_costs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh(device.type, (comm.world_size,))
    plain = torch.ones(64, device=device)
    replicated = distribute_tensor(plain.clone(), mesh, [Replicate()])
    n = 200
    dtensor = (_timed(lambda: [replicated.mul_(1.0) for _ in range(n)], repeats, sync)
               - _timed(lambda: [plain.mul_(1.0) for _ in range(n)], repeats, sync)) / n
    x = torch.ones(2, 8, device=device)

    def stacks(wrap, quiet: bool = False) -> list[float]:
        """Per PROBE_LAYERS: seconds a wrapped stack's forward and backward takes beyond the bare
        stack's (`quiet`: inside DDP's no_sync)."""
        out = []
        for layers in PROBE_LAYERS:
            torch.manual_seed(0)
            unit, bare = (torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).to(device)
                          for _ in range(2))
            unit = wrap(unit)

            def step(u=unit):
                with u.no_sync() if quiet else contextlib.nullcontext():
                    u(x).sum().backward()
            out.append(_extra(step, lambda b=bare: b(x).sum().backward(), comm, max(repeats, least[0]), sync))
        return out

    tensors = [2 * layers for layers in PROBE_LAYERS]  # a weight and a bias per layer
    out = {"dtensor_op_s": max(dtensor, 0.0)}
    if comm.world_size > 1:
        (sync_s, per_param), (local_s, _) = (_fit(stacks(DistributedDataParallel, quiet), tensors)
                                             for quiet in (False, True))
        out.update(ddp_sync_s=sync_s, ddp_local_s=local_s, ddp_param_s=per_param)
    split = stacks(lambda m: parallelize_module(m, mesh, {str(i): ColwiseParallel() if i % 2 == 0
                                                          else RowwiseParallel() for i in range(len(m))}))
    out["tp_layer_s"] = _fit(split, list(PROBE_LAYERS))[1]
    out.update(fsdp_costs(comm, device, max(repeats, least[1]), sync, mesh, (widths[0], widths[-1]), reference))
    return out


def _extra(wrapped, bare, comm: Comm, repeats: int, sync) -> float:
    """Seconds `wrapped()` takes beyond `bare()`: the two in turn, the median of the differences (the
    machine's drift cancels), started together on every rank."""
    comm.barrier(label="probe")
    return statistics.median(_timed(wrapped, 1, sync) - _timed(bare, 1, sync) for _ in range(repeats))


def _fit(costs: list[float], amounts: list[float], calls: int = 1) -> tuple[float, float]:
    """(seconds per call, per unit of `amount`) of a cost measured at two amounts, the first of them
    made of `calls` calls."""
    per_unit, fixed = line_through((amounts[0], costs[0]), (amounts[1], costs[1]), min_slope=0.0)
    return max(fixed, 0.0) / calls, per_unit


def fsdp_costs(comm: Comm, device: torch.device, repeats: int, sync, mesh,
               widths=(REFERENCE_WIDTHS[0], REFERENCE_WIDTHS[-1]), reference: Reference = CPU_REFERENCE
               ) -> dict[str, float]:
    """FSDP2 (ZeRO 3: every block and the root sharded, resharded after forward) on the reference GPT at
    two `widths` (the reference's narrowest and widest), forward and backward against the same model
    unsharded: the extra seconds fitted as a cost per collective call (2 blocks and the root: 5
    all-gathers, 3 reduce-scatters) and per byte gathered or reduced (copy-in, copy-out, the network).
    Stacks of tiny layers cannot show the second: on a GPT's blocks most of FSDP2's cost is per byte
    (~1.4 ns per byte here, 4-5 ms for a 3 MiB block, against ~1 ms per call)."""
    from torch.distributed.fsdp import fully_shard

    from shoal.models.gpt import Block

    x = torch.randint(0, reference.vocab, (reference.batch, reference.seq_len), device=device)

    def fwd_bwd(bundle):
        bundle.loss_fn(bundle.model, {"input": x, "target": x}).sum().backward()
        bundle.model.zero_grad(set_to_none=True)
    extra, moved = [], []
    for width in widths:
        torch.manual_seed(0)
        plain = _reference_bundle(width, device, reference)
        torch.manual_seed(0)
        sharded = _reference_bundle(width, device, reference)
        blocks = [m for m in sharded.model.modules() if isinstance(m, Block)]
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(sharded.model, mesh=mesh)
        extra.append(_extra(lambda s=sharded: fwd_bwd(s), lambda p=plain: fwd_bwd(p), comm, repeats, sync))
        block = sum(p.numel() * p.element_size() for p in plain.model.blocks[0].parameters())
        rest = sum(p.numel() * p.element_size() for p in plain.model.parameters()) - len(blocks) * block
        # gathered: each block in forward, again in backward but the last; the root twice; reduced once each
        moved.append(block * (2 * len(blocks) - 1) + 2 * rest + block * len(blocks) + rest)
    calls = (2 * len(blocks) - 1) + 2 + (len(blocks) + 1)  # the same at both widths
    call, per_byte = _fit(extra, moved, calls)
    return {"fsdp_call_s": call, "fsdp_byte_s": per_byte}

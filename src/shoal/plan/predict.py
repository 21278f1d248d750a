"""Per-rank memory and step time of one layout, predicted from the model's meta-device trace
(cost.py) and a hardware profile (hardware.py). The largest rank is predicted, as summary.json's
memory_per_rank is read (the rank that runs out first).

Memory, the quantities metrics/memory.py measures (STATE_KINDS), each parameter counted where it lives
(params, grads, optimizer and the parameters' copies in buffers: parallel/state_bytes.py, which the
preflight's memory check shares):
  params      tp splits what the model's tp plan splits (a Hugging Face model's embeddings, norms and head
              stay whole on every tp rank); pp keeps the rank's stages' layers; ZeRO 2/3 (FSDP2) shard
              every tensor's first dimension over dp (rank 0's chunk is the ceiling)
  grads       as params for ZeRO 2/3; whole (this rank's tp/pp part) for ZeRO 0/1; none when frozen
  optimizer   AdamW: 2 fp32 moments + a one-element step per parameter; SGD: the momentum buffer;
              ZeRO 1 gives whole parameters to ranks greedily by size (ZeroRedundancyOptimizer), 2/3 shard
  activations what autograd saves for backward (a parameter's views are the parameter; memory saved
              twice counted once), per micro-batch in flight (pp: 1F1B's first stage holds pp, interleaved
              1F1B's (v + 1) pp - 1 of its v stages, GPipe all m); under activation checkpointing block
              inputs, and one block's saved tensors while it is recomputed (one micro-batch at a time);
              tp splits only what lies between a column- and a row-parallel layer (cost.SPLIT), sequence
              parallelism also the norms' inputs, dropout masks and residual stream (Korthikanti et al.
              2022, section 4.2: 34 + 5as/h bytes per token and hidden unit of a layer in 16 bits; tp t:
              10 + 24/t + 5as/(ht))
  buffers     ZeRO 2 keeps every block's gathered parameters from forward to backward, ZeRO 3 two
              blocks (one prefetched), in the gather's dtype (16 bits under bf16); ZeRO 0/1 in 16 bits:
              autocast's 16-bit copy of every weight matrix, kept for backward
  working     on a GPU, the most the micro-batch's forward and backward hold at once beyond the saved
              activations, as the trace followed every tensor from the operator that makes it to its last
              use (cost._Live): for a language model the start of backward, the fp32 log-probabilities'
              gradient and the logits' gradient before its cast (8 bytes a logit), or under model.loss_chunks
              one chunk's; activations' gradients elsewhere; on CPU the largest tensor's gradient (the
              probe's heap measurement was made against it); tp's share
  data        the data source's tensors each worker holds (CPU: counted in its resident memory)
  peak        the worker's resident memory before a model (profile's process_bytes; 0 on a GPU) + data
              + all of the above; on CPU the tensors' part as the probe measured the resident set grow
              in training (a fixed part and a ratio: the heap keeps what it frees in pieces); on a GPU
              the tensors the caching allocator has handed out (torch.cuda.max_memory_allocated), counted
              with every gradient though a step's first backward starts with none (a margin of the
              gradients' bytes where the peak is the start of backward)
  on a GPU, what the device holds beyond the peak (the profile's, measured by the probe on the GPU; a
  preset's from public figures):
  reserve     the caching allocator's reserved blocks beyond the allocated peak (rounding, cached free
              blocks): peak x (allocator_reserve - 1)
  context     the CUDA context and the kernels loaded into it (context_bytes)
  nccl        each NCCL communicator's buffers (nccl_bytes): one for the world and one per parallel
              group that is neither one rank nor the world
  device      peak + reserve + context + nccl: what must fit in the GPU's memory (--memory)
Time, per optimizer step of the slowest rank:
  compute     on CPU every traced operator at the rate the probe measured for it in reference training
              steps: with FLOPs, FLOPs / its FLOP/s at that many FLOPs (the matmul curve for one never
              measured); without, bytes / its bytes per second at that size (the copy bandwidth for one
              never measured); + the profile's per-operator cost; under ZeRO 2/3 the bytes of tensors
              freshly mapped (allocator.py) at the measured cost per byte. On a GPU each kernel of the
              autocast trace by kind and size (kernels.py) from the profile's peak and bandwidth, in one
              stream the host issues at its time per operator (host_op_s; compiled: a launch); under
              train.compile each run of memory-bound operators one kernel (fusion.py); the optimizer's
              step torch's fused kernels (a probe's measured rate for them where it has one).
              A stack that keeps every activation in 16 bits (the unfused pricing of published runs):
              the fp32 trace's activation bytes halved (sixteen_bit_scale: their memory, the memory-bound
              operators, tp's and pp's messages). tp divides FLOPs and bytes, not operators; all of it
              divided by the profile's compute_efficiency where it has one
  comm        from the profile's collective curves, interpolated by message size (a preset: its network's
              model for each group's size and placement, plan/network.py), with the overlap each
              strategy allows (on CPU none: gloo reduces on the cores the compute has): DDP's bucketed
              all-reduce hides under backward but its last bucket, plus DDP's measured cost per
              micro-batch and its division of the sums; ZeRO 1 adds a broadcast of each
              parameter from its owner after the step; ZeRO 2/3 all-gather each block per micro-batch (ZeRO 3 again in
              backward) and reduce-scatter once per step, plus FSDP2's measured cost per call and per
              parameter tensor and DTensor's per optimizer operator (gathers in the compute dtype,
              reduce-scatters in precision.reduce_dtype); tp: per split matrix and micro-batch the
              probe's measured cost of a split layer (DTensor and an all-reduce between layers) and
              what the activations' all-reduce costs beyond its tiny one, under checkpointing the
              row-parallel layers' all-reduces again in the recomputed forward; pp sends
              activations and gradients between stages
  bubble      pipeline idle time: (p-1)/(v m + p-1) of the stage's busy time (v stages per rank)
  calibration what the formulas miss, as the probe measured it for the layout's strategy on its reference
              GPT trained by shoal (plan/calibrate.py): step = a x (compute + comm + bubble) + b
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from shoal.hardware import OVERHEAD_MESSAGE_BYTES, HardwareProfile, interpolate
from shoal.layout import Layout
from shoal.parallel.pipeline import bubble_fraction
from shoal.parallel.state_bytes import ModelShape, copies, shard_bytes, state_bytes
from shoal.plan.cost import MicroBatchCost, Ops
from shoal.plan.fusion import FUSED
from shoal.plan.kernels import fused_step_seconds, kernel_seconds
from shoal.plan.network import network

DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's bucket_cap_mb
DEFAULT_OP_OVERHEAD_S = {"cpu": 5e-6, "cuda": 6e-6}  # a preset has no measured one: a kernel launch
# a preset's host time per operator of an eager step (Python, dispatch, autocast, the autograd engine, the launch),
# where no probe measured it: 26 us and 31 us measured by shoal's probe (host_op_s) on the two GPU servers met
# (16-core Xeons beside an H100 and an H200, torch 2.11)
DEFAULT_HOST_OP_S = 28e-6


@dataclass(frozen=True)
class MoEExchange:
    """What expert parallelism moves in each of a mixture of experts' MoE layers per micro-batch on a rank
    (parallel/experts.py): its `rows` (every token's top_k choices, `row_bytes` each in the compute dtype, `cast`
    there from fp32 under autocast), sent after the counts, one int64 for each of the `experts`."""

    layers: int
    rows: int
    row_bytes: int
    experts: int
    cast: bool = False

    @property
    def rows_bytes(self) -> float:
        return float(self.rows * self.row_bytes)


@dataclass
class Prediction:
    memory: dict[str, int]  # params, grads, optimizer, activations, buffers, peak (bytes, largest rank)
    time: dict[str, float | None]  # compute, comm, bubble, step (seconds); comm None: no curves

    @property
    def step_time(self) -> float | None:
        return self.time["step"]

    @property
    def fit_bytes(self) -> int:
        """What must fit in a rank's memory: on a GPU the device's total (the allocator's peak, its reserve,
        the CUDA context, NCCL's buffers), elsewhere the peak."""
        return self.memory.get("device", self.memory["peak"])


def in_flight(layout: Layout, schedule: str, stages_per_rank: int = 1) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of all its
    layers: GPipe all m; 1F1B pp (pp - 1 warm-up forwards, then one more before the first backward);
    interleaved 1F1B (v stages a rank) (v - 1) pp + 2 (pp - 1) warm-up forwards of one stage and one more,
    at most all m v (torch's ScheduleInterleaved1F1B, as Megatron-LM's: Korthikanti et al. 2022, section
    4.2.3, L (1 + (p - 1) / (p v)) layers)."""
    d, m = layout.dims, layout.pp_microbatches
    if d.pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "interleaved-1f1b" and stages_per_rank > 1:
        v = stages_per_rank
        return min(m * v, (v + 1) * d.pp - 1) / v
    return min(m, d.pp)


def predict_memory(shape: ModelShape, params: list, cost: MicroBatchCost, layout: Layout, *, optimizer: str,
                   momentum: float, checkpointing: bool, schedule: str, profile: HardwareProfile | None,
                   stage_fraction: float, data_bytes: int = 0, dtype: str = "fp32",
                   stages_per_rank: int = 1, sequence_parallel: bool = False, act_scale: float = 1.0,
                   held: tuple[ModelShape, list] | None = None, busiest: int = 0) -> dict[str, int]:
    """`held`: the shape and parameters the state is counted from where they differ from those compute gathers
    (parallel.ep under ZeRO 2/3: state_bytes.expert_split). `busiest`: the activations the busiest ep rank's
    experts keep beyond a balanced step's (planner.expert_activations)."""
    d = layout.dims
    n_micro = layout.per_rank_batch // max(cost.micro_batch, 1)
    state = state_bytes(*(held or (shape, params)), layout, optimizer=optimizer, momentum=momentum)
    gpu = profile is not None and profile.device == "cuda"
    act = cost.activation_bytes(checkpointing, stage_fraction, in_flight(layout, schedule, stages_per_rank),
                                scale=act_scale, tp=d.tp, sequence_parallel=sequence_parallel,
                                recomputed=not gpu) // layout.cp  # cp: a rank holds 1 / cp of each sequence
    act += busiest
    working = int(cost.largest * act_scale) // (d.tp * layout.cp)
    if gpu:  # a recomputed block's saved tensors come back after the start of backward, the loss's peak
        working = int(max(cost.working_on_rank(d.tp), cost.recomputed_block(d.tp, sequence_parallel)
                          if checkpointing else 0) * act_scale) // layout.cp
    mem = {**state, "activations": act, "buffers": copies(shape, params, layout, dtype, state["params"]),
           "working": working, "data": data_bytes}
    cpu = profile is not None and profile.device == "cpu"
    base = (profile.process_bytes or 0) if cpu else 0
    tensors = sum(v for k, v in mem.items() if k != "data")
    if gpu and not grads_kept(layout, n_micro):  # the step's first backward starts without gradients
        tensors -= int(mem["grads"] * (1.0 - cost.grads_at_peak))
    if cpu and profile.heap_ratio:  # the heap keeps freed pieces: resident memory grows by more (plan/probe/steps.py)
        tensors = (profile.heap_fixed_bytes or 0) + profile.heap_ratio * tensors
    mem["peak"] = int(base + data_bytes + tensors)
    if gpu:
        mem.update(device_beyond(profile, layout, mem["peak"]))
    return mem


def grads_kept(layout: Layout, n_micro: int) -> bool:
    """Whether gradients exist when a micro-batch's backward starts: DDP's (ZeRO 0/1 over dp > 1) live in
    its buckets from its start, and an accumulating step's later micro-batches add to the earlier ones';
    otherwise a step's gradients are set to None after it (training/step.py) and made by its backward."""
    return (layout.dims.dp > 1 and layout.zero <= 1) or n_micro > 1


def device_beyond(profile: HardwareProfile, layout: Layout, peak: int) -> dict[str, int]:
    """A GPU's memory beyond the allocated peak (reserve, context, nccl) and the device's total; a term the
    profile has not measured counts 0."""
    d = layout.dims
    reserve = int(peak * max((profile.allocator_reserve or 1.0) - 1.0, 0.0))
    groups = (d.world_size > 1) + sum(1 < n < d.world_size for n in (d.dp, d.tp, d.pp))
    out = {"reserve": reserve, "context": profile.context_bytes or 0, "nccl": groups * (profile.nccl_bytes or 0)}
    return {**out, "device": peak + sum(out.values())}


def sixteen_bit_scale(profile: HardwareProfile | None, dtype: str) -> float:
    """Bytes of an activation against the fp32 trace's in a stack that keeps every activation in 16 bits on a
    GPU (Megatron-LM's and DeepSpeed's fp16 / bf16 models, Korthikanti et al.'s count: the planner's
    unfused-attention pricing, benchmarks/published_runs.py); shoal's own runs are traced under autocast."""
    return 0.5 if autocast_dtype(profile, dtype) is not None else 1.0


def autocast_dtype(profile: HardwareProfile | None, dtype: str) -> torch.dtype | None:
    """The dtype a run's trace is made under (cost.trace_micro_batch): a GPU run in bf16 / fp16 keeps and
    moves its tensors in the dtypes autocast gives them (16-bit matrix products and attention, an fp32
    residual stream and loss); on CPU the fp32 trace, as the probe measured its operators' rates and the
    resident memory's growth against it."""
    if profile is not None and profile.device == "cuda" and dtype in ("bf16", "fp16"):
        return torch.bfloat16 if dtype == "bf16" else torch.float16
    return None


def op_time(ops: Ops, profile: HardwareProfile, dtype: str, scale: float = 1.0, byte_scale: float = 1.0,
            compiled: bool = False) -> float:
    """Seconds of the operators, each on `scale` of its data (tp's share), their bytes at `byte_scale` of the
    traced ones (sixteen_bit_scale), on a GPU `compiled` by torch.compile (fusion.py), divided by the
    profile's compute efficiency; kept on `ops` per profile, dtype, scales and compilation, which many
    layouts share (the entry holds the profile, so its id stays its own)."""
    key = (id(profile), dtype, scale, byte_scale, compiled)
    if key not in ops.times:
        seconds = _op_time(ops, profile, dtype, scale, byte_scale, compiled) / (profile.compute_efficiency or 1.0)
        ops.times[key] = (profile, seconds)
    return ops.times[key][1]


def step_at_efficiency(t: dict[str, float | None], efficiency: float) -> float:
    """The step of a prediction made at compute efficiency 1 (`t`'s parts) had the profile's compute
    efficiency been `efficiency`: compute and bubble scale, communication and calibration do not (the
    overlap windows are taken as they were: a close estimate, used to search for a factor)."""
    return (t["compute"] + t["bubble"]) / efficiency + t["comm"] + (t.get("calibration") or 0.0)


def _op_time(ops: Ops, profile: HardwareProfile, dtype: str, scale: float, byte_scale: float = 1.0,
             compiled: bool = False) -> float:
    """On CPU each operator at its measured rate plus the per-operator cost; on a GPU each kernel by kind and
    size, in one stream the host issues (_gpu_op_time)."""
    if profile.device == "cuda":
        return _gpu_op_time(ops, profile, dtype, scale, byte_scale, compiled)
    bw = profile.memory_bandwidth or 1e11
    overhead = profile.op_overhead_s if profile.op_overhead_s is not None else DEFAULT_OP_OVERHEAD_S.get(
        profile.device, 5e-6)
    total = 0.0
    for name, flops, moved in ops.items:
        flops, moved = flops * scale, moved * scale * byte_scale
        if flops:
            t = max(moved / bw, flops / profile.op_flop_rate(name, dtype, flops))
        else:
            t = moved / profile.op_rate(name, moved)
        total += t + overhead
    return total


def host_op_seconds(profile: HardwareProfile, compiled: bool = False) -> float:
    """The host's time to issue one kernel on a GPU: in an eager step, what a probe measured per operator of
    a step of small kernels (host_op_s: Python, dispatch, autocast, autograd and the launch), else
    DEFAULT_HOST_OP_S; in a compiled graph the launch alone (its wrapper runs no Python per operator)."""
    if compiled:
        return profile.op_overhead_s or DEFAULT_OP_OVERHEAD_S["cuda"]
    return (profile.model_extra or {}).get("host_op_s") or DEFAULT_HOST_OP_S


def _gpu_op_time(ops: Ops, profile: HardwareProfile, dtype: str, scale: float, byte_scale: float,
                 compiled: bool = False) -> float:
    """Each kernel by kind and size (kernels.py) from the profile's peak and bandwidth, measured or the data
    sheet's, issued by the host one after another. Not the probe's per-operator rates: timed one call at a
    time with a wait on the device, they price short kernels at their latency (on an H200 they put an eager
    GPT-2 step at twice what it took, where the kernel model was within 3%)."""
    launch = host_op_seconds(profile, compiled)
    fused = ops.fused if compiled and ops.fused else None
    host = device = 0.0
    for i, (name, flops, moved) in enumerate(ops.items):
        if fused is not None:  # torch.compile: a run of memory-bound operators is one kernel (fusion.py)
            if fused[i] == FUSED:
                continue
            moved = fused[i]
        flops, moved = flops * scale, moved * scale * byte_scale
        shape = ops.shapes.get(i)
        if shape is not None and scale != 1.0:  # tp splits the product's columns (or its inner dimension)
            shape = (shape[0], shape[1], max(1, round(shape[2] * scale)), shape[3])
        # one stream: the host issues each kernel `launch` after the last, the GPU runs it once issued and
        # free. Long products let the host run ahead; a run of small kernels waits on the host (an eager
        # GPT-2 at micro-batch 8 on an H200: 23.5 ms of kernels by this model, 32.2 ms a step measured)
        host += launch
        device = max(device, host) + kernel_seconds(name, flops, moved, shape, profile, dtype)
    return device


def _hidden(comm: float, under: float, cuda: bool) -> float:
    """What of `comm` is left exposed when it runs beside `under` seconds of compute. On CPU nothing
    hides: gloo moves and reduces the bytes on the same cores the compute has taken."""
    return max(0.0, comm - under) if cuda else comm


def group_of(layout: Layout, gpus_per_node: int, axis: str, ep: int = 1) -> tuple[int, int]:
    """(ranks, of them in one node) of `axis`'s group: ranks are placed pp-major, tp innermost
    (topology.ParallelDims), `gpus_per_node` to a node. A pipeline hop crosses nodes once the pipeline
    does (the slowest hop sets its pace). An ep group is `ep` consecutive dp ranks (parallel/experts.py)."""
    d, g = layout.dims, max(gpus_per_node, 1)
    if axis == "tp":
        return d.tp, min(d.tp, g)
    if axis == "dp":
        return d.dp, max(1, min(d.dp, g // d.tp))
    if axis == "ep":
        return ep, max(1, min(ep, g // d.tp))
    if axis == "cp":  # consecutive dp ranks (parallel/apply.py context_parallel)
        return layout.cp, max(1, min(layout.cp, g // d.tp))
    if axis == "dp_shard":  # HSDP's shard group: consecutive dp ranks
        return d.dp_shard, max(1, min(d.dp_shard, g // d.tp))
    if axis == "dp_replicate":  # one rank of each shard group, dp_shard x tp ranks apart
        return d.dp_replicate, max(1, min(d.dp_replicate, g // (d.dp_shard * d.tp)))
    return 2, 2 if d.world_size <= g else 1


def collectives(profile: HardwareProfile, layout: Layout, ep: int = 1):
    """ct(op, bytes, axis): a collective's seconds over `axis`'s group, the message as the probe's curves
    key it (what one rank contributes: an all-gather's shard, a reduce-scatter's whole input). From the
    curves (measured over the whole group, whatever the axis), else the preset's network (plan/network.py)
    for the group's size and placement; None without either."""
    if not profile.network:
        return lambda op, nbytes, axis="dp": profile.collective_time(op, nbytes)
    net = network(profile.network)

    def ct(op: str, nbytes: float, axis: str = "dp") -> float:
        n, per_node = group_of(layout, profile.nproc, axis, ep)
        return net.seconds(op, nbytes * n if op == "all_gather" else nbytes, n, per_node)

    return ct


def predict_time(shape: ModelShape, cost: MicroBatchCost, opt_ops: Ops, layout: Layout, profile: HardwareProfile, *,
                 dtype: str, checkpointing: bool, schedule: str, stages_per_rank: int, grad_bytes: int,
                 param_bytes_full: int, reduce_dtype: str = "fp32", act_scale: float = 1.0,
                 compiled: bool = False, ep: int = 1, exchange: MoEExchange | None = None,
                 experts: tuple[float, float] = (0.0, 1.0),
                 gathered: tuple[int, int] = (0, 0)) -> dict[str, float | None]:
    """`ep` > 1: parallel.ep, `exchange` (planner.moe_exchange) for its all-to-alls (_ep_comm) and the dispatch's
    own work (_ep_dispatch); `shape`, `grad_bytes` and `param_bytes_full` then a rank's
    (state_bytes.expert_split). `experts`: a mixture of experts' (share of the FLOPs its routed experts compute,
    the most tokens a rank's experts take over the mean): under ep the others wait for the busiest rank; under
    tp every tp rank computes its experts whole (moe.tensor_parallel), where the operators are priced at 1 / tp
    of their work, and the probe's tp calibration, fitted to a model tp splits all of, leaves that part alone.
    `gathered`: under parallel.cp, (attention layers, the bytes of keys and values a rank holds of a micro-batch)
    for its gathers (_cp_comm)."""
    d, zero = layout.dims, layout.zero
    micro = cost.micro_batch
    n_micro = layout.per_rank_batch // micro
    # cp: a rank computes 1 / cp of each sequence, head-tail chunks that balance the causal attention's work
    per_micro = op_time(cost.ops, profile, dtype, 1.0 / d.tp, act_scale, compiled) / (d.pp * layout.cp)
    fwd_share = cost.forward_flops / max(cost.ops.flops, 1.0)
    if checkpointing:
        per_micro *= 1 + fwd_share  # blocks run their forward again in backward
    share, imbalance = experts  # ep: the rank whose experts took the most tokens; tp: experts computed whole
    whole = per_micro * share * d.tp * n_micro if d.tp > 1 else 0.0
    per_micro *= 1 + share * ((imbalance - 1.0 if ep > 1 else 0.0) + d.tp - 1)
    shard = (1.0 / layout.shard_ranks if zero >= 1 else 1.0) / (d.tp * d.pp)
    compute = per_micro * n_micro + _optimizer_time(opt_ops, profile, dtype, layout)
    if ep > 1 and exchange:
        compute += _ep_dispatch(profile, dtype, n_micro, exchange, checkpointing)
    if zero >= 2 and profile.fresh_memory_s_per_byte:  # CPU: every large tensor freshly mapped (allocator.py)
        compute += profile.fresh_memory_s_per_byte * (cost.ops.fresh_bytes * n_micro / (d.tp * d.pp)
                                                      + opt_ops.fresh_bytes * shard)
    bubble = 0.0
    if d.pp > 1:
        bubble = per_micro * n_micro * bubble_fraction(d.pp, n_micro, stages_per_rank) / (
            1 - bubble_fraction(d.pp, n_micro, stages_per_rank))
    t = {"compute": compute, "bubble": bubble}
    if d.world_size > 1 and not profile.collectives and not profile.network:
        t.update(comm=None, step=None)
        return t
    comm = 0.0
    if d.dp > 1 and zero <= 1:
        comm += _ddp_comm(shape, profile, layout, n_micro, grad_bytes, per_micro * (1 - fwd_share))
    elif d.dp > 1:
        seconds, fresh = _fsdp_comm(shape, profile, layout, n_micro, param_bytes_full, per_micro, len(opt_ops.items),
                                    dtype, reduce_dtype)
        comm += seconds
        t["compute"] = compute = compute + (profile.fresh_memory_s_per_byte or 0.0) * fresh
    if d.tp > 1:
        comm += _tp_comm(shape, cost, profile, layout, n_micro, len(opt_ops.items), act_scale, checkpointing)
    if ep > 1 and exchange:
        comm += _ep_comm(profile, layout, ep, n_micro, exchange, checkpointing)
    comm += _cp_comm(profile, layout, n_micro, gathered, checkpointing)
    if d.pp > 1:
        act = (cost.block_input[0] if cost.block_input else 0) * act_scale
        hops = 2 * (n_micro + d.pp - 1) * stages_per_rank
        comm += hops * (collectives(profile, layout)("send_recv", act, "pp") or 0.0)
    t["comm"] = comm
    t["step"] = compute + bubble + comm
    return calibrated(t, layout, profile, exempt=whole)


def _optimizer_time(opt_ops: Ops, profile: HardwareProfile, dtype: str, layout: Layout) -> float:
    """The clip and the optimizer's step on a rank's share of the parameters (ZeRO's shard, tp's and pp's
    part): on a GPU torch's fused kernels (training/optim.py), elsewhere the traced per-tensor operators."""
    d = layout.dims
    shard = (1.0 / layout.shard_ranks if layout.zero >= 1 else 1.0) / (d.tp * d.pp)
    if profile.device == "cuda":
        # the fused AdamW as a probe timed it, in the run's dtype's steps (one kernel over every tensor: long
        # enough that its wait on the device is a small part), else by the bandwidth
        extra = profile.model_extra or {}
        rates = (extra.get("op_rates_by_dtype", {}).get(dtype) if dtype != "fp32" else None) or profile.op_rates
        adamw = interpolate(rates.get("_fused_adamw_", []), opt_ops.fused_bytes, extrapolate_linear=False)
        seconds = opt_ops.fused_bytes / adamw if adamw else fused_step_seconds(opt_ops.fused_bytes, profile)
        return seconds / (profile.compute_efficiency or 1.0) * shard
    if layout.zero >= 1:
        return op_time(opt_ops, profile, dtype, 1.0) * shard
    return op_time(opt_ops, profile, dtype, 1.0 / (d.tp * d.pp))


def strategy(layout: Layout) -> str:
    """What the probe's calibration keys a layout by: pp, else tp, else its ZeRO stage (dp for none)."""
    d = layout.dims
    if d.pp > 1:
        return "pp"
    if d.tp > 1:
        return "tp"
    return f"zero{layout.zero}" if layout.zero else "dp"


def calibrated(t: dict[str, float | None], layout: Layout, profile: HardwareProfile,
               exempt: float = 0.0) -> dict[str, float | None]:
    """The step as the probe's calibration of this layout's strategy corrects it (plan/calibrate.py), but for
    `exempt` seconds of it that the strategy does not touch; `calibration` is the correction, so that compute +
    bubble + comm + calibration = step. Never below half the formulas' step."""
    a, b = profile.calibration.get(strategy(layout), (1.0, 0.0))
    step = max(a * (t["step"] - exempt) + b + exempt, 0.5 * t["step"])
    t["calibration"] = step - t["step"]
    t["step"] = step
    return t


def _ddp_comm(shape: ModelShape, profile: HardwareProfile, layout: Layout, n_micro: int, grad_bytes: int,
              backward: float) -> float:
    """dp with ZeRO 0/1: DDP's bucketed all-reduce from the curves (hidden under backward on a GPU but its
    last bucket), DDP's own measured work per micro-batch, the last one's with a small all-reduce in
    place of the first bucket's latency; its division of the reduced gradients by the world size (one
    pass over them: they are the buckets' views, nothing is copied); ZeRO 1's broadcast of each
    parameter from the rank that updated it (ZeroRedundancyOptimizer)."""
    d, ct, over = layout.dims, collectives(profile, layout), profile.parallel_overheads
    buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
    each = ct("all_reduce", grad_bytes / buckets) or 0.0
    comm = each + _hidden(each * (buckets - 1), backward, profile.device == "cuda")
    if "ddp_sync_s" in over:
        comm += (over["ddp_sync_s"] - (ct("all_reduce", OVERHEAD_MESSAGE_BYTES["stack"]) or 0.0)
                 + (n_micro - 1) * over["ddp_local_s"] + n_micro * len(shape.params) * over["ddp_param_s"])
    comm += 2 * grad_bytes / (profile.memory_bandwidth or 1e11)
    if layout.zero == 1:
        comm += sum(ct("send_recv", n * shape.element_size / (d.tp if split else 1))
                    or ct("all_gather", n * shape.element_size / d.dp) or 0.0
                    for n, _, _, trainable, split in shape.params if trainable)
    return comm


def _fsdp_comm(shape: ModelShape, profile: HardwareProfile, layout: Layout, n_micro: int, param_bytes_full: int,
               per_micro: float, optimizer_ops: int, dtype: str = "fp32",
               reduce_dtype: str = "fp32") -> tuple[float, float]:
    """ZeRO 2/3 (FSDP2): (seconds, bytes of FSDP2's buffers that are freshly mapped on CPU). Per
    micro-batch each block is gathered for its forward (ZeRO 2 keeps it through backward, then frees
    it), ZeRO 3 again for its backward but the last block's; the root (the layers outside blocks)
    likewise; gradients are reduced once per step (the last micro-batch). Priced as the probe measured
    FSDP2 on a GPT (per call and per byte moved), else the collectives alone from the curves; DTensor's
    cost per optimizer operator (the shards are DTensors). FSDP2's mixed precision under bf16
    (precision.sharded_mixed_precision) gathers 16-bit parameters, half an fp32 model's bytes, and reduces
    gradients in `reduce_dtype`. Under HSDP (parallel.dp_replicate) the gathers and the reduce-scatter run
    over a shard group's links (in a node, when it fits one) and each block's reduced shard is all-reduced
    across the replicas (over the nodes), overlapped with the backward as the reduce-scatter is."""
    d, zero, ct, over = layout.dims, layout.zero, collectives(profile, layout), profile.parallel_overheads
    n_blocks = max(len(shape.block_params), 1)
    in_blocks = shape.once(("in blocks", d.tp), lambda: sum(
        shard_bytes(shape, b, 1, False, d.tp, shape.element_size, "params") for b in shape.block_params))
    block_bytes = (in_blocks or param_bytes_full) / n_blocks
    rest_bytes = max(param_bytes_full - n_blocks * block_bytes, 0.0)  # the root's: embeddings, head
    half = dtype in ("bf16", "fp16")
    g, r = (0.5 if half else 1.0), (0.5 if half and reduce_dtype == "bf16" else 1.0)  # of the fp32 bytes
    gathers = n_blocks * n_micro * (2 if zero == 3 else 1) - (n_micro if zero == 3 else 0)
    root_gathers = n_micro * (2 if zero == 3 else 1)
    if "fsdp_call_s" in over:
        moved = (gathers * g + n_blocks * r) * block_bytes + (root_gathers * g + r) * rest_bytes
        comm = (gathers + root_gathers + n_blocks + 1) * over["fsdp_call_s"] + moved * over["fsdp_byte_s"]
    else:
        cuda, block_compute = profile.device == "cuda", per_micro / n_blocks
        axis = "dp_shard" if d.dp_replicate > 1 else "dp"
        gather = ct("all_gather", block_bytes * g / layout.shard_ranks, axis) or 0.0
        scatter = ct("reduce_scatter", block_bytes * r, axis) or 0.0
        comm = (gather + (gathers - 1) * _hidden(gather, block_compute, cuda)
                + scatter + (n_blocks - 1) * _hidden(scatter, block_compute, cuda))
    if d.dp_replicate > 1:  # HSDP: each reduced shard all-reduced across the replicas, a block at a time
        cuda, block_compute = profile.device == "cuda", per_micro / n_blocks
        reduce = ct("all_reduce", block_bytes * r / layout.shard_ranks, "dp_replicate") or 0.0
        comm += reduce + (n_blocks - 1) * _hidden(reduce, block_compute, cuda)
    comm += optimizer_ops * over.get("dtensor_op_s", 0.0)
    # per all-gather the block's gathered flat buffer and its parameters copied out of it, per
    # reduce-scatter its flat input and output, and each micro-batch's unsharded gradients (the gathered
    # parameters' dtype)
    fresh = (2 * gathers * g + 2 * n_blocks * r) * block_bytes + n_micro * param_bytes_full * g
    return comm, fresh


def _ep_comm(profile: HardwareProfile, layout: Layout, ep: int, n_micro: int, ex: MoEExchange,
             checkpointing: bool) -> float:
    """Expert parallelism (parallel/experts.py): in each MoE layer and micro-batch, an all-to-all of the counts
    (a small message: its latency), then the rows out to their experts and the results back, each as much as
    the layer's rows (spread evenly: a balanced step), in forward and their gradients in backward; a recomputed
    forward (checkpointing) runs the first three again. On the layer's path, none hidden: the experts wait for
    the rows, the next layer for the results. Where the profile has no all-to-all curve (a plan's spot
    measurement, a probe before it measured one), a reduce-scatter of the same bytes moves as much."""
    ct = collectives(profile, layout, ep)

    def a2a(nbytes: float) -> float:
        return ct("all_to_all", nbytes, "ep") or ct("reduce_scatter", nbytes, "ep") or 0.0

    forward = a2a(8 * ex.experts) + 2 * a2a(ex.rows_bytes)
    return n_micro * ex.layers * (forward * (2 if checkpointing else 1) + 2 * a2a(ex.rows_bytes))


def _cp_comm(profile: HardwareProfile, layout: Layout, n_micro: int, gathered: tuple[int, int],
             checkpointing: bool) -> float:
    """Context parallelism (parallel/context.py): in each attention layer and micro-batch the group's keys and
    values all-gathered in forward, and in backward gathered again and their gradients reduce-scattered; a
    recomputed forward (checkpointing) gathers once more. On the attention's path, none of it hidden. 0 without
    cp."""
    layers, nbytes = gathered
    if layout.cp == 1 or not layers:
        return 0.0
    ct = collectives(profile, layout)
    gather = ct("all_gather", nbytes, "cp") or 0.0
    scatter = ct("reduce_scatter", nbytes * layout.cp, "cp") or 0.0
    return n_micro * layers * (gather * (3 if checkpointing else 2) + scatter)


def _ep_dispatch(profile: HardwareProfile, dtype: str, n_micro: int, ex: MoEExchange, checkpointing: bool) -> float:
    """Expert parallelism's work on a rank besides its all-to-alls, which the trace of the whole layer does not
    hold (the operators parallel/experts.py runs, traced once on CPU): in forward the rows' cast to the compute
    dtype (under autocast), the permutation into expert order built from the counts and its inverse (index
    vectors of one int64 a row), the arrived rows gathered into expert order and the results back into arrival
    order; in backward each gather's gradient scattered into zeros. Three reads of the counts on the host per
    forward (the splits, the rows arrived): on a GPU each waits for the queued kernels, and the device then for
    the host's next launch (host_op_seconds, not yet measured there). A balanced step: a rank receives as many
    rows as it sends. A recomputed forward (checkpointing) runs it all again."""
    b, i = ex.rows_bytes, 8.0 * ex.rows
    order = [("arange", 0.0, i), ("repeat_interleave", 0.0, 2 * i), ("index_select", 0.0, 2 * i), ("sub", 0.0, 3 * i),
             ("repeat_interleave", 0.0, 2 * i), ("index_select", 0.0, 2 * i), ("add", 0.0, 3 * i),
             ("arange", 0.0, i), ("index_put_", 0.0, 3 * i)]
    cast = [("_to_copy", 0.0, 3 * b)] if ex.cast else []  # fp32 read, 16 bits written
    forward = op_time(Ops([*cast, *order, ("index", 0.0, 2 * b + i), ("index", 0.0, 2 * b + i)]), profile, dtype)
    forward += 3 * host_op_seconds(profile) if profile.device == "cuda" else 0.0
    backward = op_time(Ops([("new_zeros", 0.0, b), ("index_put", 0.0, 3 * b + i)] * 2), profile, dtype)
    return n_micro * ex.layers * (forward * (2 if checkpointing else 1) + backward)


def _tp_comm(shape: ModelShape, cost: MicroBatchCost, profile: HardwareProfile, layout: Layout, n_micro: int,
             optimizer_ops: int, act_scale: float = 1.0, checkpointing: bool = False) -> float:
    """Tensor parallelism: one all-reduce of a block's activations per split matrix and micro-batch (a
    row-wise layer's output in forward, a column-wise layer's input gradient in backward), at the probe's
    measured cost of a split layer (DTensor's work and a tiny all-reduce between layers) plus what a
    message of the activations' size costs more; under checkpointing the row-wise layers' all-reduces
    again in the recomputed forward; DTensor's cost per optimizer operator on split parameters."""
    d, over = layout.dims, profile.parallel_overheads
    ct = partial(collectives(profile, layout), axis="tp")
    act = (cost.block_input[0] if cost.block_input else 0) * act_scale
    matrices, outside, tensors = shape.once(("tp matrices",), lambda: _matrices(shape))
    message = max(0.0, (ct("all_reduce", act) or 0.0) - (ct("all_reduce", OVERHEAD_MESSAGE_BYTES["tp"]) or 0.0))
    per_layer = over["tp_layer_s"] + message if "tp_layer_s" in over else (ct("all_reduce", act) or 0.0)
    split = min(1.0, 2 * matrices / max(tensors, 1))  # the matrices and biases
    layers = n_micro * (matrices / d.pp + outside) * per_layer
    if checkpointing:
        layers += n_micro * cost.row_parallel / d.pp * (ct("all_reduce", act) or 0.0)
    return layers + over.get("dtensor_op_s", 0.0) * split * optimizer_ops / d.pp


def _matrices(shape: ModelShape) -> tuple[int, int, int]:
    """(matrices in blocks, matrices outside them, tensors in blocks): what tp splits."""
    matrices = sum(sum(1 for p in b if p[2] >= 2) for b in shape.block_params)
    return matrices, sum(1 for p in shape.params if p[2] >= 2) - matrices, sum(len(b) for b in shape.block_params)

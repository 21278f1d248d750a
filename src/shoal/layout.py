"""The layout of a run: how its work is split once the world size is known.

`resolve_layout` is a pure function of the config, the world size and whether CUDA is there (no
hardware is probed inside it), so the launcher, `shoal parity` and the planner to come can ask what
any world size would give. It refuses, in one line naming the keys and a value that works, every
combination that torch would otherwise reject inside the workers. Derived values (degrees, gradient
accumulation, pipeline micro-batches) are computed here only; they are printed at start and never
stored as a second source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config import Config
from shoal.errors import UserError
from shoal.topology import ParallelDims


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda": where each worker trains
    zero: int
    grad_accum: int  # micro-batches per rank per optimizer step
    per_rank_batch: int  # samples per rank per optimizer step
    pp_microbatches: int = 0  # pp > 1: micro-batches per step through the pipeline
    replicas: int = 1  # models kept apart between periodic syncs (local SGD, DiLoCo); 1: every step
    servers: int = 0  # parameter-server ranks (the last ones of the world), outside dims
    micro_batch: int = 1  # samples per forward and backward: train.micro_batch_size, at most a rank's share
    cp: int = 1  # parallel.cp: the dp ranks that train on the same sequences, each on its part of them

    @property
    def batch_ranks(self) -> int:
        """The ranks the global batch is split over: dp, or under context parallelism its groups (dp / cp)."""
        return self.dims.dp // self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO shards the state over: every dp rank, one replica's under local SGD / DiLoCo, one
        shard group's under HSDP (parallel.dp_replicate)."""
        return self.dims.dp // (self.replicas * self.dims.dp_replicate)

    def describe(self, cfg: Config, items_name: str, items_per_sample: int) -> str:
        t, d = cfg.train, self.dims
        if d.pp > 1:
            split = (f"{self.per_rank_batch // self.pp_microbatches} x dp {d.dp} x {self.pp_microbatches} "
                     f"pipeline micro-batches")
        elif self.cp > 1:
            split = (f"micro {self.micro_batch} x dp {self.batch_ranks} x accumulation {self.grad_accum}, each "
                     f"sequence split over cp {self.cp}")
        else:
            split = f"micro {self.micro_batch} x dp {d.dp} x accumulation {self.grad_accum}"
        zero = f", ZeRO {self.zero}" if self.zero else ""
        if d.dp_replicate > 1:
            zero += f" sharded over {d.dp_shard} ranks, {d.dp_replicate} replicas (HSDP)"
        on = " on cuda" if self.backend == "gloo" and self.device == "cuda" else ""
        mode = cfg.sync.mode
        sync = (f"; {self.replicas} replicas of {d.dp // self.replicas} dp rank(s), {mode} every {cfg.sync.every} "
                f"steps" if mode != "every-step" else "")
        compressed = f"; {cfg.comm.compression} compression" if cfg.comm.compression != "none" else ""
        if self.servers:
            sync = (f"; ranks {d.world_size}-{d.world_size + self.servers - 1} serve the parameters "
                    f"(parameter server, {cfg.ps.mode}"
                    f"{f', max staleness {cfg.ps.max_staleness}' if cfg.ps.mode == 'async' else ''}), "
                    f"ranks 0-{d.world_size - 1} train")
        ranks = f"dp {self.batch_ranks} x cp {self.cp}" if self.cp > 1 else f"dp {d.dp}"
        return (f"world {d.world_size} = {ranks} x tp {d.tp} x pp {d.pp}{zero} ({self.backend}{on}); global batch "
                f"{t.global_batch_size} = {split}; {t.global_batch_size * items_per_sample:,} {items_name} per step"
                f"{sync}{compressed}")


def choose_device(requested: str, cuda: bool) -> str:
    """parallel.device resolved: "cuda" or "cpu"."""
    if requested == "auto":
        return "cuda" if cuda else "cpu"
    if requested == "cuda" and not cuda:
        raise UserError('parallel.device = "cuda", but CUDA is not available here (`shoal env` says why); use '
                        '"cpu" or "auto"')
    return requested


def choose_backend(requested: str, device: str) -> str:
    """parallel.backend resolved for workers on `device`: NCCL on GPUs, gloo on CPUs, unless asked."""
    if requested == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if requested == "nccl" and device != "cuda":
        raise UserError('parallel.backend = "nccl" runs on GPUs, but the workers train on the CPU (CUDA is not '
                        'available, or parallel.device = "cpu"); use "gloo" or "auto"')
    return requested


def check_gpus_per_node(layout: Layout, nproc: int, gpus: int) -> None:
    """NCCL takes one GPU per process: a node cannot start more NCCL workers than it has GPUs."""
    if layout.backend == "nccl" and nproc > gpus:
        raise UserError(f"--nproc {nproc} starts {nproc} workers on this node, but it has {gpus} GPU(s) and NCCL "
                        f"takes one GPU per process; use --nproc {gpus} (or more nodes), or set parallel.backend = "
                        f'"gloo" to let workers share GPUs (slower; docs/gpus.md)')


def resolve_layout(cfg: Config, world_size: int, cuda: bool) -> Layout:
    p, t = cfg.parallel, cfg.train
    servers = cfg.ps.servers if cfg.sync.mode == "parameter-server" else 0
    if servers and world_size <= servers:
        raise UserError(f"ps.servers = {servers} leaves no process to train in a world of {world_size}; start "
                        f"more processes (--nproc {servers + 1} or more) or use fewer servers")
    dims = ParallelDims.resolve(p.dp, p.tp, p.pp, world_size - servers, p.dp_replicate)
    device = choose_device(p.device, cuda)
    backend = choose_backend(p.backend, device)
    if p.cp > 1:
        _check_context(cfg, dims)
    if cfg.data.pack_documents:
        _check_packing(cfg, dims)
    batch_ranks = dims.dp // p.cp
    micro = micro_batch(t.global_batch_size, t.micro_batch_size, batch_ranks)
    _check_sharding(cfg, dims, device, world_size)
    if p.ep > 1:
        _check_experts(cfg, dims)
    _check_precision(cfg, device)
    check_cuda_graphs(cfg, device)
    per_rank = t.global_batch_size // batch_ranks
    microbatches = _pipeline_microbatches(cfg, dims, per_rank, micro) if dims.pp > 1 else 0
    replicas = _replicas(cfg, dims) if cfg.sync.mode in ("local-sgd", "diloco") else 1
    return Layout(dims, backend, device, p.zero, per_rank // micro, per_rank, microbatches, replicas, servers,
                  micro, p.cp)


def micro_batch(global_batch: int, micro: int, dp: int) -> int:
    """The samples of one forward and backward: train.micro_batch_size, or a rank's whole share of the global
    batch where that is smaller (gpt-tiny's 32 at micro-batch 16 over 8 GPUs: 4 each, in one micro-batch).
    The micro-batch is a bound on what one pass holds; the global batch is the recipe, kept as set (so it is
    in Accelerate and DeepSpeed, where the rest is derived from it). A share it does not split is refused."""
    if global_batch % dp == 0 and micro >= global_batch // dp:
        return global_batch // dp
    if global_batch % (micro * dp):
        raise UserError(f"train.global_batch_size ({global_batch}) must be divisible by train.micro_batch_size "
                        f"({micro}) x dp ({dp}) = {micro * dp}; " + batch_fix(global_batch, micro, dp))
    return micro


def batch_fix(global_batch: int, micro: int, dp: int) -> str:
    """Both ways out of a global batch that micro-batch x dp does not divide: the largest micro-batch up to this
    one that splits each rank's share (the global batch, and so the recipe, unchanged: more accumulation, as
    Accelerate and DeepSpeed keep the global batch and derive the rest), or the next larger global batch."""
    step = micro * dp
    larger = f"train.global_batch_size = {-(-global_batch // step) * step} (a multiple of {step}; a larger batch)"
    if global_batch % dp:  # no micro-batch splits a share that is not whole
        return f"set {larger}, or a multiple of dp ({dp}) with a micro-batch that divides each rank's share"
    per_rank = global_batch // dp
    fits = max(m for m in range(1, min(micro, per_rank) + 1) if per_rank % m == 0)
    samples, parts = f"sample{'s' if per_rank > 1 else ''}", f"micro-batch{'es' if per_rank // fits > 1 else ''}"
    return (f"set train.micro_batch_size = {fits} (the same global batch: {per_rank} {samples} a rank in "
            f"{per_rank // fits} {parts}), or {larger}")


def _replicas(cfg: Config, dims: ParallelDims) -> int:
    """local-sgd / diloco: how many replicas train apart between syncs."""
    p = cfg.parallel
    replicas = cfg.sync.replicas or dims.dp
    if dims.dp % replicas:
        raise UserError(f"sync.replicas ({replicas}) must divide dp ({dims.dp}); set it to a divisor of {dims.dp}")
    if replicas < dims.dp and (dims.tp > 1 or dims.pp > 1):
        raise UserError(f"sync.replicas = {replicas} < dp ({dims.dp}) with tp {dims.tp} x pp {dims.pp} is not "
                        f"supported: replicas spanning several dp ranks are built for data parallelism alone; set "
                        f"sync.replicas = 0 (each dp rank's tp x pp ranks are one replica)")
    if p.zero and replicas == dims.dp:
        raise UserError(f"parallel.zero = {p.zero} shards a replica over its dp ranks, but sync.replicas = "
                        f"{replicas} leaves one rank per replica; set sync.replicas to at most {dims.dp // 2}, "
                        f"or parallel.zero = 0")
    return replicas


def _check_sharding(cfg: Config, dims: ParallelDims, device: str, world_size: int) -> None:
    p = cfg.parallel
    if p.zero and dims.dp == 1:
        raise UserError(f"parallel.zero = {p.zero} shards state across the dp ranks, but dp = 1 (world {world_size} = "
                        f"tp {dims.tp} x pp {dims.pp}): there is nothing to shard across; set parallel.zero = 0 "
                        f"or start more processes")
    if p.zero == 1 and dims.tp > 1:
        raise UserError(f"parallel.zero = 1 with parallel.tp = {dims.tp} is not supported (ZeroRedundancyOptimizer "
                        f"cannot shard tensor-parallel parameters); use parallel.zero = 2 or 3, which compose with tp")
    if p.zero == 1 and dims.pp > 1:
        raise UserError(f"parallel.zero = 1 with parallel.pp = {dims.pp} is not supported (ZeroRedundancyOptimizer "
                        f"needs DDP, which cannot run under a pipeline schedule); use parallel.zero = 2 or 3")
    if p.offload and p.zero < 2:
        raise UserError(f"parallel.offload = true needs parallel.zero = 2 or 3 (FSDP2), not {p.zero}")
    if dims.dp_replicate > 1:
        _check_hsdp(cfg, dims)
    if p.offload and device != "cuda":
        raise UserError("parallel.offload = true moves sharded state from GPU to CPU memory; this run trains on "
                        "the CPU already: set parallel.offload = false")


def _check_experts(cfg: Config, dims: ParallelDims) -> None:
    """parallel.ep: a mixture of experts whose experts and dp ranks it divides, on the layouts built for it."""
    ep, m = cfg.parallel.ep, cfg.model
    routed = m.routed_experts()
    if routed is None:
        raise UserError(f"parallel.ep = {ep} splits a mixture of experts' experts, but model.name = \"{m.name}\" has "
                        f"none; set parallel.ep = 1, or model.name = \"moe\"")
    experts, key = routed
    if experts % ep:
        raise UserError(f"parallel.ep ({ep}) must divide {key} ({experts}); set parallel.ep to a divisor of {experts}")
    if dims.dp % ep:
        raise UserError(f"parallel.ep ({ep}) must divide the data-parallel ranks (dp {dims.dp}); set parallel.ep to a "
                        f"divisor of {dims.dp} or start a multiple of {ep} processes")
    if cfg.parallel.zero == 1:
        raise UserError(f"parallel.ep = {ep} with parallel.zero = 1 is not built yet: ZeRO 1's optimizer shards whole "
                        f"weights over the dp ranks, and no rank holds all of an expert-parallel weight; set "
                        f"parallel.zero = 2 (or 0, or 3)")
    if cfg.sync.mode != "every-step":
        raise UserError(f"parallel.ep = {ep} is built with data parallelism synchronised every step, not yet with "
                        f"sync.mode = \"{cfg.sync.mode}\"; set sync.mode = \"every-step\"")


def _check_context(cfg: Config, dims: ParallelDims) -> None:
    """parallel.cp: sequences it splits evenly, over dp ranks it divides, with an attention it can replace."""
    cp, m = cfg.parallel.cp, cfg.model
    seq_len = getattr(m, "seq_len", None)
    if seq_len is None:  # what else a model needs (its positions taken, its attention replaced): preflight.py
        raise UserError(f"parallel.cp = {cp} splits each sequence over {cp} ranks, but model.name = \"{m.name}\" "
                        f"trains on no sequences (model.seq_len); set parallel.cp = 1")
    if seq_len % (2 * cp):
        raise UserError(f"parallel.cp = {cp} cuts each sequence into 2 x {cp} = {2 * cp} equal chunks (head-tail), "
                        f"but model.seq_len = {seq_len} is not a multiple of {2 * cp}; set model.seq_len to a "
                        f"multiple of {2 * cp}")
    if dims.dp % cp:
        raise UserError(f"parallel.cp ({cp}) must divide the data-parallel ranks (dp {dims.dp}); set parallel.cp to a "
                        f"divisor of {dims.dp} or start a multiple of {cp} processes")
    if getattr(m, "dropout", 0.0):
        raise UserError(f"parallel.cp = {cp} replaces causal attention without dropout, but model.dropout = "
                        f"{m.dropout} drops attention weights; set model.dropout = 0 or parallel.cp = 1")
    if getattr(m, "task", "causal-lm") != "causal-lm":
        raise UserError(f"parallel.cp = {cp} replaces causal attention, but model.task = \"{m.task}\" attends both "
                        f"ways; set parallel.cp = 1")
    others = ["parallel.ep"] if cfg.parallel.ep > 1 else []
    others += [f'{k} = "{v}"' for k, v, usual in (("sync.mode", cfg.sync.mode, "every-step"),
                                                  ("balance.mode", cfg.balance.mode, "uniform")) if v != usual]
    if others:
        what = others[0]
        raise UserError(f"parallel.cp = {cp} with {what} is not built yet; set parallel.cp = 1 (cp composes with dp, "
                        f"ZeRO 1-3, tp and pp)")


def _check_packing(cfg: Config, dims: ParallelDims) -> None:
    """data.pack_documents: a causal model, not split into stages (what else a model needs, its positions taken
    and its attention replaced: preflight.py)."""
    if getattr(cfg.model, "task", "causal-lm") != "causal-lm":
        raise UserError(f"data.pack_documents keeps causal attention inside each document, but model.task = "
                        f"\"{cfg.model.task}\" attends both ways; set data.pack_documents = false")
    if dims.pp > 1:
        raise UserError(f"data.pack_documents with parallel.pp = {dims.pp} is not built yet (a stage's attention "
                        f"would need the documents' positions); set data.pack_documents = false or parallel.pp = 1")


def _check_hsdp(cfg: Config, dims: ParallelDims) -> None:
    """parallel.dp_replicate > 1: ZeRO 2/3's shards replicated across groups of dp ranks, every step."""
    r, zero = dims.dp_replicate, cfg.parallel.zero
    if zero < 2:
        raise UserError(f"parallel.dp_replicate = {r} replicates ZeRO 2/3's shards across {r} groups (HSDP), but "
                        f"parallel.zero = {zero} shards no parameters; set parallel.zero = 3 (or 2), or "
                        f"parallel.dp_replicate = 1")
    if dims.dp_shard == 1:
        raise UserError(f"parallel.dp_replicate = {r} = dp leaves one rank in each shard group: nothing is sharded "
                        f"(that is DDP); set parallel.zero = 0, or a dp_replicate that leaves 2 or more ranks a group")
    if cfg.sync.mode != "every-step":
        raise UserError(f'parallel.dp_replicate = {r} (HSDP) all-reduces across its replicas every step; sync.mode = '
                        f'"{cfg.sync.mode}" keeps replicas of its own: set parallel.dp_replicate = 1 (its replicas '
                        f"are sync.replicas)")


def _check_precision(cfg: Config, device: str) -> None:
    dtype = cfg.precision.dtype
    if dtype == "fp16" and cfg.parallel.zero >= 2:
        raise UserError('precision.dtype = "fp16" with parallel.zero >= 2 is not supported (loss scaling of '
                        'sharded gradients); use "bf16"')
    if dtype == "fp16" and device != "cuda":
        raise UserError('precision.dtype = "fp16" trains on GPUs only (loss scaling); on the CPU use "bf16" or '
                        '"fp32"')
    if dtype == "fp8" and cfg.precision.fp8_all_gather is True and cfg.parallel.zero < 2:
        raise UserError(f"precision.fp8_all_gather = true gathers ZeRO 2/3's weights in float8, but parallel.zero = "
                        f'{cfg.parallel.zero} gathers none; set parallel.zero = 2 or 3, or fp8_all_gather = "auto"')


def check_cuda_graphs(cfg: Config, device: str) -> None:
    """CUDA graphs (train.compile's reduce-overhead and max-autotune modes) for workers on `device` ("cpu" or
    "cuda"); what else they need of the layout is checked with the config (config/root.py)."""
    if cfg.train.cuda_graphs and device != "cuda":
        raise UserError(f'train.compile = "{cfg.train.compile}" captures CUDA graphs, but the workers train on the '
                        f'CPU (CUDA is not available, or parallel.device = "cpu"); use train.compile = true')


def _pipeline_microbatches(cfg: Config, dims: ParallelDims, per_rank: int, micro: int) -> int:
    """Micro-batches per step through the pipeline, checked against what torch's schedules accept:
    1F1B and interleaved 1F1B need at least one per stage of the group (a pipeline with fewer
    micro-batches than stages never fills); the interleaved schedule runs them in rounds of pp."""
    p, t, pp = cfg.parallel, cfg.train, dims.pp
    microbatches = p.pp_microbatches or per_rank // micro
    if per_rank % microbatches:
        raise UserError(f"parallel.pp_microbatches ({microbatches}) must divide the per-rank batch ({per_rank} = "
                        f"train.global_batch_size / dp)")
    if per_rank < pp:
        raise UserError(f"parallel.pp = {pp} needs at least {pp} micro-batches per rank and step, but each rank "
                        f"gets only {per_rank} samples (train.global_batch_size {t.global_batch_size} / dp {dims.dp}); "
                        f"set train.global_batch_size to at least {pp * dims.dp}")
    fix = _microbatch_fix(per_rank, pp)
    if p.pp_schedule != "gpipe" and microbatches < pp:
        got = (f"parallel.pp_microbatches = {microbatches}" if p.pp_microbatches else
               f"train.micro_batch_size ({t.micro_batch_size}) gives each rank {microbatches} (per-rank batch "
               f"{per_rank} = train.global_batch_size {t.global_batch_size} / dp {dims.dp})")
        raise UserError(f'parallel.pp_schedule = "{p.pp_schedule}" needs at least parallel.pp ({pp}) micro-batches '
                        f"per step, but {got}; {fix}")
    if p.pp_schedule == "interleaved-1f1b" and microbatches % pp:
        raise UserError(f'parallel.pp_schedule = "interleaved-1f1b" needs the micro-batches ({microbatches}) to be '
                        f"a multiple of parallel.pp ({pp}); {fix}")
    return microbatches


def _microbatch_fix(per_rank: int, pp: int) -> str:
    """A setting that gives a valid number of pipeline micro-batches (a multiple of pp dividing the
    per-rank batch), or what to change when there is none."""
    for m in range(pp, per_rank + 1, pp):
        if per_rank % m == 0:
            return f"set train.micro_batch_size = {per_rank // m} or parallel.pp_microbatches = {m}"
    return f"make the per-rank batch ({per_rank}) a multiple of parallel.pp ({pp}) through train.global_batch_size"


def check_live(cfg: Config, nodes: tuple[int, int], nproc: int) -> None:
    """A live elastic run (--nnodes MIN:MAX) of this config: its smallest world can hold the layout, and the
    layout can heal live (each worker holds a whole replica, so survivors can go on without one)."""
    p, text = cfg.parallel, f"{nodes[0]}:{nodes[1]}"
    need, least = p.tp * p.pp, nodes[0] * nproc
    if least < need:
        raise UserError(f"--nnodes {text}: MIN x --nproc = {least} workers, below the parallel.tp x parallel.pp = "
                        f"{need} one replica needs; raise MIN to {-(-need // nproc)} or more")
    why = (f"parallel.tp = {p.tp} and parallel.pp = {p.pp} split a replica over several workers"
           if need > 1 else f"parallel.zero = {p.zero} shards each replica's state over the workers" if p.zero else
           f"sync.replicas = {cfg.sync.replicas} makes one replica of several workers" if cfg.sync.replicas else
           f'sync.mode = "{cfg.sync.mode}" sends through parameter servers' if cfg.sync.mode == "parameter-server" else
           f"sync.fragments = {cfg.sync.fragments} and sync.fragment_delay = {cfg.sync.fragment_delay} keep the "
           f"replicas apart at every step but the last" if cfg.sync.fragments > 1 or cfg.sync.fragment_delay else
           f'balance.mode = "{cfg.balance.mode}" splits the batch by measured throughput'
           if cfg.balance.mode != "uniform" else
           "data.streaming = true keeps each dp rank's place in its own documents" if cfg.data.streaming else None)
    if why:
        raise UserError(f"--nnodes {text}: {why}, which cannot heal live yet (a live run needs every worker to hold "
                        f"a whole replica: data parallel, parallel.zero = 0, each worker its own replica); give a "
                        f"fixed --nnodes instead: a failure then restarts every worker from the newest checkpoint "
                        f"(--max-restarts)")

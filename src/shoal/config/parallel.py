"""[parallel], [sync], [ps], [balance], [comm]: how the work is laid out over the processes, how the
data-parallel replicas stay one model, the parameter server's own settings, how the batch is split
over uneven ranks, and what the replicas send."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shoal.config.base import Section


class ParallelConfig(Section):
    dp: int | Literal["auto"] = "auto"
    """Data-parallel degree; "auto" uses every process left after tp and pp."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: each layer split over this many ranks (the model's ModelBundle.tensor_parallel;
    gpt has one)."""
    ep: int = Field(1, ge=1)
    """Expert parallelism (a mixture of experts: model.name = "moe", or a transformers Mixtral, Qwen2-MoE or
    Qwen3-MoE): each layer's experts split over groups of this many dp ranks, tokens sent to their experts' ranks
    and back by all-to-all; the experts are replicated over the groups (sharded over them under ZeRO 2/3). Divides
    dp and the experts; not with ZeRO 1 yet."""
    cp: int = Field(1, ge=1)
    """Context parallelism: each sequence split over groups of this many dp ranks (head-tail chunks of
    seq_len / (2 cp) tokens), attention computed over the whole sequence from the group's gathered keys and
    values; the group's ranks train on the same sequences (the batch is split over dp / cp groups) and their
    gradients are reduced over every dp rank. Divides dp; seq_len divisible by 2 cp."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree: the model's layers split into stages over this many ranks (the
    model's ModelBundle.pipeline; gpt has one)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """Pipeline schedule; interleaved-1f1b gives each rank pp_stages_per_rank stages."""
    pp_microbatches: int = Field(0, ge=0)
    """Micro-batches per step flowing through the pipeline; 0: per-rank batch / train.micro_batch_size.
    When set, the pipeline's micro-batch is per-rank batch / pp_microbatches."""
    pp_stages_per_rank: int = Field(2, ge=1)
    """interleaved-1f1b: stages (virtual stages) each pp rank holds."""
    pp_split: list[int] = []
    """Layers per stage, in order (e.g. [3, 3] for pp = 2); empty: balanced by the per-layer cost (pp_balance)."""
    pp_balance: Literal["flops", "time"] = "flops"
    """Per-layer cost the automatic split balances: "flops" (the forward FLOPs the model declares; the same split
    on every machine) or "time" (each layer's forward + backward measured at start on one micro-batch,
    averaged over the ranks; catches costs FLOPs miss, such as a large vocabulary's loss)."""
    sequence_parallel: bool = False
    """With tp > 1: run the norms, residual adds and dropout on 1/tp of the sequence instead of
    replicated (the model's tensor-parallel function decides what that means; gpt supports it)."""
    zero: int = Field(0, ge=0, le=3)
    """ZeRO stage within dp: 0 replicates everything (DDP); 1 shards the optimizer state
    (ZeroRedundancyOptimizer); 2 also the gradients and 3 also the parameters (FSDP2 `fully_shard`;
    2 keeps a block's gathered parameters from forward to backward, 3 frees them after forward)."""
    dp_replicate: int = Field(1, ge=1)
    """ZeRO 2/3 as HSDP (torchtitan's data_parallel_replicate_degree, DeepSpeed's hpZ): the dp ranks form
    this many replicas of dp / dp_replicate ranks each; the state is sharded within a replica and
    replicated across them (FSDP2 on a 2-D mesh), so the gathers stay inside a replica (a node) and only
    each step's gradient all-reduce crosses replicas. 1: every dp rank shares one shard group."""
    offload: bool = False
    """ZeRO 2/3 on CUDA: keep parameters, gradients and optimizer state in CPU memory and run the
    optimizer step there (FSDP2 CPUOffloadPolicy)."""
    memory_check: bool = True
    """Refuse, before any worker starts, a layout whose model state cannot fit one rank: its parameters,
    gradients and optimizer state as the layout shards them, and the largest block gathered on top, against
    its GPU's memory (on the CPU: the node's available memory over its workers); activations are not
    counted. false: start anyway (memory the check cannot see: unified memory, swap)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend; auto: nccl when the workers train on GPUs, gloo otherwise."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each worker trains; auto: a GPU when CUDA is available (local rank r on GPU r, one process per
    GPU), the CPU otherwise. "cuda" with backend "gloo" lets several workers share a GPU (local rank r on GPU
    r mod the GPUs): NCCL refuses two ranks on one GPU, gloo does not, so one GPU can run a multi-rank layout
    (slower than NCCL: for testing CUDA code paths, not for speed)."""
    threads_per_worker: int = Field(0, ge=0)
    """CPU threads per worker; 0: cores / local workers."""
    timeout_s: float = Field(600.0, gt=0.0)
    """A collective that waits longer than this fails the run instead of hanging it. An asynchronous
    parameter server drops a worker that sent nothing for this long (it stalled), and a worker that
    lost its servers waits this long for restarted ones."""

    @model_validator(mode="after")
    def _supported(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel = true splits the sequence over the tp ranks, but tp = 1; "
                             "set parallel.tp > 1 or sequence_parallel = false")
        if self.dp != "auto" and self.dp < 1:
            raise ValueError(f'parallel.dp = {self.dp} must be >= 1 or "auto"')
        return self


SyncMode = Literal["every-step", "local-sgd", "diloco", "parameter-server"]


class SyncConfig(Section):
    mode: SyncMode = "every-step"
    """How the dp replicas stay one model. every-step: gradients averaged every step (DDP / FSDP2).
    local-sgd: each replica steps alone on its slice of the batch; parameters are averaged every `every`
    steps. diloco: each replica takes `every` inner optimizer steps, then the averaged difference from
    the last synchronised parameters is the gradient of an outer Nesterov SGD step (Douillard et al. 2023).
    parameter-server: [ps] servers ranks hold the parameters and optimizer state (sharded by whole
    tensors); the other ranks train, push their gradients to the servers and pull the new parameters
    every step (ps.mode = "sync": the same training as every-step)."""
    every: int = Field(50, ge=1)
    """local-sgd / diloco: steps between synchronisations (H)."""
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    """diloco: the outer optimizer's learning rate (the paper's 0.7)."""
    outer_momentum: float = Field(0.0, ge=0.0, lt=1.0)
    """diloco: the outer optimizer's Nesterov momentum (0: plain SGD). The paper's 0.9 is made for rounds of
    hundreds of steps from a trained start; in a short job from scratch (25 rounds of 8 steps,
    benchmarks/diloco_outer.py) 0.9 never reached the target loss, 0 and 0.2 did, as soon as local SGD."""
    warmup_steps: int = Field(0, ge=0)
    """local-sgd / diloco: the first this many steps average the replicas' parameters at every step (no outer
    step) before the rounds of `every` start, as DiLoCo's paper starts from a model trained every step."""
    fragments: int = Field(1, ge=1)
    """local-sgd / diloco: streaming (Douillard et al. 2025): the model's blocks split into this many
    fragments of consecutive blocks, each synchronised at its own step of the round (staggered by every /
    fragments; with fragments > every some share a step), so one synchronisation carries 1/fragments of the
    model. Must divide the blocks."""
    fragment_delay: int = Field(0, ge=0)
    """local-sgd / diloco: steps a fragment's synchronisation overlaps: its pseudo-gradient is sent at its
    step and applied this many steps later while the replicas train on (0: applied at once, training waits)."""
    fragment_alpha: float = Field(0.5, ge=0.0, le=1.0)
    """fragment_delay > 0: how much of its own progress since the send a replica keeps when the new
    parameters land: params <- alpha params + (1 - alpha) synchronised (the paper's 0.5; 0: drop it)."""
    replicas: int = Field(0, ge=0)
    """local-sgd / diloco: how many replicas the dp ranks form (0: each dp rank is one). The dp / replicas
    ranks of a replica train it together, synchronising gradients every step (DDP, or sharded with
    parallel.zero 1-3, as islands of fast links); the periodic sync runs between the replicas."""

    @model_validator(mode="after")
    def _replicas(self) -> SyncConfig:
        if self.replicas and self.mode == "every-step":
            raise ValueError(f"sync.replicas = {self.replicas} groups the dp ranks into replicas for sync.mode "
                             f'= "local-sgd" or "diloco"; every-step keeps one replica: leave replicas = 0')
        periodic = self.mode in ("local-sgd", "diloco")
        if self.warmup_steps and not periodic:
            raise ValueError(f"sync.warmup_steps = {self.warmup_steps} warms up the rounds of sync.mode = "
                             f'"local-sgd" or "diloco"; leave it at 0 for "{self.mode}"')
        if (self.fragments > 1 or self.fragment_delay) and not periodic:
            raise ValueError(f"sync.fragments = {self.fragments} and sync.fragment_delay = {self.fragment_delay} "
                             f'stream the synchronisation of sync.mode = "local-sgd" or "diloco"; leave them at 1 '
                             f'and 0 for "{self.mode}"')
        if periodic and self.fragment_delay >= self.every:
            raise ValueError(f"sync.fragment_delay = {self.fragment_delay} must land before the fragment's next "
                             f"synchronisation, sync.every = {self.every} steps later; set fragment_delay < every")
        return self


class PSConfig(Section):
    servers: int = Field(1, ge=1)
    """sync.mode = "parameter-server": how many of the processes serve (the last ones); the others train."""
    mode: Literal["sync", "async"] = "sync"
    """sync: the servers wait for every worker's gradients of a step, then step once (every-step data
    parallelism on another wire). async: each worker's gradient (its share of a global batch, normalised
    by its own items) is applied on arrival, and the worker pulls the parameters and its next share of
    data from the servers; a slow worker no longer holds the others back. An update of m shares
    (m = `aggregate`) of n is applied at m / n of the schedule's learning rate (the linear scaling rule:
    n updates then move as far as one synchronous step)."""
    aggregate: int = Field(1, ge=1)
    """async: updates a server averages into one step (each clipped by its own norm first), applied as
    soon as that many arrived from any workers; 1: each on arrival. The number of workers gives steps of
    the synchronous batch size without waiting for the slowest."""
    sparse: bool = False
    """Send embedding tables (nn.Embedding) by rows: a push carries the rows the batch touched, a pull the
    rows that changed since the worker's last pull. Exact (the same training as dense); few rows change
    only under an optimizer that leaves untouched rows alone (SGD without momentum or weight decay), so
    with AdamW only the pushes shrink."""
    max_staleness: int = Field(4, ge=0)
    """async: how many updates a worker may push beyond the slowest live worker before it waits
    (stale-synchronous parallel; 0: in step with the slowest)."""


class BalanceConfig(Section):
    mode: Literal["uniform", "throughput"] = "uniform"
    """How the global batch is split over the dp ranks. uniform: global_batch_size / dp each. throughput:
    each rank's share in proportion to its measured samples per second of compute (re-measured as the run
    goes, agreed every `interval` steps), for workers of uneven speed; the same samples and the same
    gradient as uniform (the loss is normalised over the whole global batch). dp with parallel.zero 0 or
    1 and sync.mode = "every-step" only."""
    interval: int = Field(10, ge=1)
    """mode = "throughput": steps between agreements of the ranks' throughputs (one small all-gather); a new
    split takes effect data.prefetch + 1 steps after it is agreed (batches already prefetched keep theirs)."""


class CommConfig(Section):
    compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"] = "none"
    """What the dp replicas send: gradients (sync.mode = "every-step") or the pseudo-gradient (diloco,
    local-sgd). fp16/bf16: halved precision, summed in it. int8: one scale per tensor, 8-bit values. int4: one
    scale per block of 64 entries, 4-bit values (~0.56 bytes per entry). topk:
    the largest `topk_ratio` of each tensor's entries with their indices. powersgd: each matrix as a
    rank-`powersgd_rank` product (Vogels et al. 2019), vectors uncompressed. Supported with dp and ZeRO 0/1
    (DDP's comm hook) and ZeRO 2/3 (FSDP2's reduce-scatter; not powersgd); with tp or pp only under
    local-sgd / diloco."""
    topk_ratio: float = Field(0.01, gt=0.0, le=1.0)
    """compression = "topk": fraction of each tensor's entries sent."""
    powersgd_rank: int = Field(4, ge=1)
    """compression = "powersgd": rank of the approximation."""
    error_feedback: bool = True
    """int8 / int4 / topk / powersgd: keep what compression dropped (per rank, checkpointed) and add it to the next
    step's tensor (Seide et al. 2014; Karimireddy et al. 2019). Without it the dropped part is lost."""



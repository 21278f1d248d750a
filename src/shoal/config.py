"""The run configuration: one small pydantic model per TOML section, loaded, overridden and frozen.

A config is validated completely before any worker starts. Every user mistake becomes one
`UserError` line that names where the value came from (the file or `--set`), the key, the value and
what is allowed; unknown keys get the closest valid key as a suggestion.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shoal.errors import UserError
from shoal.models.registry import model_config_class

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# Sections and keys that choose how a run is laid out, computed or recorded, not what it trains: two
# configs that differ only here train the same model (`shoal parity` compares such pairs, and a run
# resumes across them)
LAYOUT_SECTIONS = ("parallel", "comm", "precision", "checkpoint", "metrics")
LAYOUT_KEYS = frozenset({"train.micro_batch_size", "train.compile", "data.cache_dir"})


class Section(BaseModel):
    # strict: a TOML string "100" is not silently an int; extra keys are errors, not ignored.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


DataSource = Literal["stdlib-text", "text", "tokens", "hf", "synthetic-images", "interactions",
                     "image-folder", "cifar10"]


class DataConfig(Section):
    source: str = "stdlib-text"
    """Where samples come from. stdlib-text: the Python standard library's .py files on this machine,
    byte tokens (no download). text: `path` is a UTF-8 file or a folder of them, byte tokens.
    tokens: `path` is a flat binary file of token ids (`token_dtype`), memory-mapped.
    hf: `path` is a Hugging Face dataset whose `text_column` is encoded by `tokenizer` (the `hf` extra),
    documents joined by `eos_token`, tokenized once and cached in `cache_dir`.
    synthetic-images: class-conditional 3x32x32 images. interactions: implicit user-item feedback.
    image-folder: `path` holds one sub-folder of PNG/JPEG images per class (Pillow: the vision extra).
    cifar10: `path` is CIFAR-10's binary folder (cifar-10-batches-bin: data_batch_*.bin, test_batch.bin).
    "package.module:function": your data set, the function called with this section (data/user.py)."""
    path: str | None = None
    """File or folder for the `text`, `tokens`, `image-folder` and `cifar10` sources. hf: a `save_to_disk`
    folder, or a parquet, jsonl, json or csv file, a folder of them or a glob (e.g. "data/*.parquet")."""
    text_column: str = "text"
    """hf: the column holding each document's text."""
    tokenizer: str | None = None
    """hf: a tokenizer.json file (`tokenizers`) or a folder saved by save_pretrained (read offline by
    transformers.AutoTokenizer). The model's vocabulary is its size, added tokens included."""
    eos_token: str | None = None
    """hf: the token put after every document; unset: the tokenizer's EOS token (a bare tokenizer.json names
    none, so one of its special tokens <|endoftext|>, </s>, <eos> or <|end_of_text|> is taken)."""
    split: str = "train"
    """hf: the split read from a `save_to_disk` folder of a DatasetDict."""
    max_documents: int = Field(0, ge=0)
    """hf: tokenize only the first this many documents (0: all)."""
    cache_dir: str | None = None
    """hf: where the tokenized stream is cached (a flat .bin memory-mapped by every worker, and a .json
    of its key and sizes); unset: $XDG_CACHE_HOME/shoal/tokens, i.e. ~/.cache/shoal/tokens."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a `tokens` file."""
    max_bytes: int = Field(8_000_000, ge=4096)
    """Text sources read at most this many bytes (the stdlib gives ~12 MB without its tests)."""
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    """Held out for validation: the tail of a text/token stream, that many extra generated images, or
    that share of each class of an image folder without a val/ folder (chosen by a hash of the file's
    path); interactions hold out one item per user instead."""
    num_samples: int = Field(20_000, ge=100)
    """synthetic-images: size of the generated training set."""
    num_classes: int = Field(10, ge=2, le=1000)
    """synthetic-images: number of classes."""
    image_size: int | None = Field(None, ge=4)
    """image-folder, cifar10: resize images to this square side (default: the first training image's
    size for a folder, which must then be square; 32 for CIFAR-10)."""
    augment: bool = True
    """image-folder, cifar10: augment training images (a random crop of the padded image, a horizontal
    flip), drawn from (train.seed, step, sample) so resume and every layout see the same pixels;
    validation images are never augmented."""
    crop_padding: int = Field(4, ge=0)
    """augment: zero pixels added on each side before the random crop back to the image size (4 for
    32x32 CIFAR, as in He et al. 2016)."""
    horizontal_flip: bool = True
    """augment: mirror half of the training images left to right (off for data such as digits or text)."""
    num_users: int = Field(2_000, ge=10)
    """interactions: number of users."""
    num_items: int = Field(1_000, ge=110)
    """interactions: number of items (at least 110: evaluation ranks 1 positive among 100)."""
    interactions_per_user: int = Field(20, ge=2)
    """interactions: positive interactions generated per user (one is held out for evaluation)."""
    negatives: int = Field(4, ge=1)
    """interactions: sampled negatives per positive in training (as in the NCF paper)."""
    prefetch: int = Field(2, ge=0, le=64)
    """Batches prepared ahead by a background thread (0: load in the training thread)."""

    @model_validator(mode="after")
    def _known_source(self) -> DataConfig:
        if ":" not in self.source and self.source not in DataSource.__args__:
            raise ValueError(f'unknown data.source = "{self.source}"; use one of {", ".join(DataSource.__args__)} '
                             f'or "package.module:function" (your data set)')
        return self


class TrainConfig(Section):
    steps: int = Field(1000, ge=1)
    """Optimizer steps to run."""
    global_batch_size: int = Field(32, ge=1)
    """Samples per optimizer step, summed over all data-parallel ranks and accumulation steps."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward/backward on one rank; accumulation = global / (micro x dp)."""
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The cosine schedule decays to lr x min_lr_ratio at the last step."""
    warmup_steps: int = Field(100, ge=0)
    """Linear warmup from 0 to lr."""
    weight_decay: float = Field(0.1, ge=0.0)
    """Decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay."""
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    """AdamW second-moment decay (0.95 as in GPT-3, steadier than 0.999 for transformers)."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value (0 disables clipping; the norm is still logged)."""
    seed: int = Field(1337, ge=0)
    """Seeds model init and the data order; the global batch at step k depends only on (seed, k)."""
    val_interval: int = Field(100, ge=0)
    """Validate every this many steps (0: only at the end)."""
    val_batches: int = Field(8, ge=1)
    """Validation batches (each of global_batch_size samples) per evaluation."""
    on_bad_step: Literal["skip", "rollback", "abort"] = "skip"
    """A NaN/inf loss or gradient norm: skip the update, roll back to the last checkpoint and skip the
    batch, or abort the run."""
    max_bad_steps: int = Field(5, ge=1)
    """skip: abort after this many bad steps in a row; rollback: abort after this many rollbacks."""
    compile: bool = False
    """torch.compile the model (first step is slow; measured no speedup for small models on CPU)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """The (inner) optimizer: AdamW, or SGD with `momentum` (weight decay as for AdamW, added to the
    gradient). Under parallel.sync = "local-sgd" / "diloco" it is what each replica steps with."""
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    """optimizer = "sgd": momentum (0: plain SGD)."""
    freeze: list[str] = []
    """Parameters left untouched: glob patterns over the model's parameter names (e.g.
    ["model.embed_tokens.*", "model.layers.0.*"]); they get no gradient and no optimizer state."""
    eval_on_start: bool = False
    """Validate once before the first step of a fresh start (summary.json: initial_val_*), e.g. to see
    what pretrained weights (model.init_from) score before fine-tuning."""


class ParallelConfig(Section):
    dp: int | Literal["auto"] = "auto"
    """Data-parallel degree; "auto" uses every process left after tp and pp."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: each layer split over this many ranks (the model's ModelBundle.tensor_parallel;
    gpt has one)."""
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
    offload: bool = False
    """ZeRO 2/3 on CUDA: keep parameters, gradients and optimizer state in CPU memory and run the
    optimizer step there (FSDP2 CPUOffloadPolicy)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend; auto: nccl when CUDA is available, gloo otherwise."""
    threads_per_worker: int = Field(0, ge=0)
    """CPU threads per worker; 0: cores / local workers."""
    timeout_s: float = Field(600.0, gt=0.0)
    """A collective that waits longer than this fails the run instead of hanging it. An asynchronous
    parameter server drops a worker that sent nothing for this long (it stalled), and a worker that
    lost its servers waits this long for restarted ones."""
    sync: Literal["every-step", "local-sgd", "diloco", "parameter-server"] = "every-step"
    """How the dp replicas stay one model. every-step: gradients averaged every step (DDP / FSDP2).
    local-sgd: each replica steps alone on its slice of the batch; parameters are averaged every `sync_every`
    steps. diloco: each replica takes `sync_every` inner optimizer steps, then the averaged difference from
    the last synchronised parameters is the gradient of an outer Nesterov SGD step (Douillard et al. 2023).
    parameter-server: `servers` ranks hold the parameters and optimizer state (sharded by whole tensors);
    the other ranks train, push their gradients to the servers and pull the new parameters every step
    (synchronous: the same training as every-step)."""
    sync_every: int = Field(50, ge=1)
    """local-sgd / diloco: steps between synchronisations (H)."""
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    """diloco: the outer optimizer's learning rate (the paper's 0.7)."""
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """diloco: the outer optimizer's Nesterov momentum (the paper's 0.9; 0: plain SGD)."""
    servers: int = Field(1, ge=1)
    """parameter-server: how many of the processes serve (the last ones); the others train."""
    ps_mode: Literal["sync", "async"] = "sync"
    """parameter-server: sync: the servers wait for every worker's gradients of a step, then step once
    (every-step data parallelism on another wire). async: each worker's gradient (its share of a global
    batch, normalised by its own items) is applied on arrival, and the worker pulls the parameters and
    its next share of data from the servers; a slow worker no longer holds the others back. An
    update of m shares (m = ps_aggregate) of n is applied at m / n of the schedule's learning rate (the
    linear scaling rule: n updates then move as far as one synchronous step)."""
    ps_aggregate: int = Field(1, ge=1)
    """parameter-server, async: updates a server averages into one step (each clipped by its own norm
    first), applied as soon as that many arrived from any workers; 1: each on arrival. The number of
    workers gives steps of the synchronous batch size without waiting for the slowest."""
    ps_sparse: bool = False
    """parameter-server: send embedding tables (nn.Embedding) by rows: a push carries the rows the batch
    touched, a pull the rows that changed since the worker's last pull. Exact (the same training as
    dense); few rows change only under an optimizer that leaves untouched rows alone (SGD without
    momentum or weight decay), so with AdamW only the pushes shrink."""
    max_staleness: int = Field(4, ge=0)
    """parameter-server, async: how many updates a worker may push beyond the slowest live worker before
    it waits (stale-synchronous parallel; 0: in step with the slowest)."""
    balance: Literal["uniform", "throughput"] = "uniform"
    """How the global batch is split over the dp ranks. uniform: global_batch_size / dp each. throughput: each
    rank's share in proportion to its measured samples per second of compute (re-measured as the run goes,
    agreed every `balance_interval` steps), for workers of uneven speed; the same samples and the same
    gradient as uniform (the loss is normalised over the whole global batch). dp with zero 0 or 1 and
    sync = "every-step" only."""
    balance_interval: int = Field(10, ge=1)
    """balance = "throughput": steps between agreements of the ranks' throughputs (one small all-gather); a new
    split takes effect data.prefetch + 1 steps after it is agreed (batches already prefetched keep theirs)."""
    replicas: int = Field(0, ge=0)
    """local-sgd / diloco: how many replicas the dp ranks form (0: each dp rank is one). The dp / replicas
    ranks of a replica train it together, synchronising gradients every step (DDP, or sharded with
    parallel.zero 1-3, as islands of fast links); the periodic sync runs between the replicas."""

    @model_validator(mode="after")
    def _supported(self) -> ParallelConfig:
        if self.sync != "every-step" and self.zero and not self.replicas:
            raise ValueError(f'parallel.sync = "{self.sync}" with zero = {self.zero}: a replica must span several dp '
                             f"ranks to be sharded over them; set parallel.replicas (dp / replicas ranks per replica) "
                             f"or zero = 0")
        if self.sync == "parameter-server" and (self.tp > 1 or self.pp > 1 or self.zero):
            raise ValueError(f'parallel.sync = "parameter-server" shards the model over the servers instead; set '
                             f"parallel.tp = 1, pp = 1 and zero = 0 (got tp {self.tp}, pp {self.pp}, zero {self.zero})")
        if self.replicas and self.sync == "every-step":
            raise ValueError(f"parallel.replicas = {self.replicas} groups the dp ranks into replicas for parallel.sync "
                             f'= "local-sgd" or "diloco"; every-step keeps one replica: leave replicas = 0')
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel = true splits the sequence over the tp ranks, but tp = 1; "
                             "set parallel.tp > 1 or sequence_parallel = false")
        if self.balance == "throughput" and (self.zero > 1 or self.tp > 1 or self.pp > 1 or self.sync != "every-step"):
            raise ValueError(f'parallel.balance = "throughput" splits the batch unevenly over dp ranks that run DDP '
                             f'(zero 0/1, tp = 1, pp = 1, sync = "every-step"); got zero {self.zero}, tp {self.tp}, '
                             f'pp {self.pp}, sync "{self.sync}": set balance = "uniform"')
        if self.dp != "auto" and self.dp < 1:
            raise ValueError(f'parallel.dp = {self.dp} must be >= 1 or "auto"')
        return self


class CommConfig(Section):
    compression: Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"] = "none"
    """What the dp replicas send: gradients (parallel.sync = "every-step") or the pseudo-gradient (diloco,
    local-sgd). fp16/bf16: halved precision, summed in it. int8: one scale per tensor, 8-bit values. topk:
    the largest `topk_ratio` of each tensor's entries with their indices. powersgd: each matrix as a
    rank-`powersgd_rank` product (Vogels et al. 2019), vectors uncompressed. Supported with dp and ZeRO 0/1
    (DDP's comm hook) and ZeRO 2/3 (FSDP2's reduce-scatter; not powersgd); with tp or pp only under
    local-sgd / diloco."""
    topk_ratio: float = Field(0.01, gt=0.0, le=1.0)
    """compression = "topk": fraction of each tensor's entries sent."""
    powersgd_rank: int = Field(4, ge=1)
    """compression = "powersgd": rank of the approximation."""
    error_feedback: bool = True
    """int8 / topk / powersgd: keep what compression dropped (per rank, checkpointed) and add it to the next
    step's tensor (Seide et al. 2014; Karimireddy et al. 2019). Without it the dropped part is lost."""


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype under autocast; parameters and optimizer state stay fp32. fp16 needs CUDA."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """ZeRO 2/3 with dtype bf16: parameters are gathered in bf16 and gradients reduced in this dtype
    (fp32: exact sums, twice the traffic)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""


class CheckpointConfig(Section):
    model_config = ConfigDict(populate_by_name=True)
    enabled: bool = True
    """Save checkpoints to run_dir/checkpoints: at the end, every `interval` steps and every
    `interval_minutes`."""
    interval: int = Field(0, ge=0)
    """Save every this many steps (0: by time only, see interval_minutes)."""
    interval_minutes: float = Field(10.0, ge=0.0)
    """Also save when this many minutes have passed since the last save (or the start), so a crash
    never costs more; 0: by steps only. All ranks agree on the step through the step's flags."""
    keep: int = Field(3, ge=1)
    """Newest complete checkpoints kept; older ones are deleted once a newer one is complete."""
    async_save: bool = Field(False, alias="async")
    """`async = true`: training continues while the checkpoint is written (its own process group). Under
    parallel.sync = "parameter-server" saves block (the servers write their state inside the workers' save)."""
    final_weights: bool = True
    """Write the trained model as run_dir/model.safetensors at the end."""


class MetricsConfig(Section):
    log_interval: int = Field(10, ge=1)
    """Write metrics.jsonl / TensorBoard every this many steps (and at the last step)."""
    tensorboard: bool = True
    """Write TensorBoard event files to run_dir/tensorboard."""
    progress: bool = True
    """Show the progress bar on rank 0."""
    profile: bool = True
    """The step profile in every step's metrics: compute, communication this rank waited for per mesh
    axis, data wait, optimizer, pipeline bubble, achieved FLOP/s and MFU; at logged steps the ranks'
    compute times, naming a straggler (README, "What the run shows")."""
    peak: str = "auto"
    """Peak FLOP/s of one worker, for MFU: "auto" (a CUDA device's data-sheet preset found by its name,
    otherwise a short matmul in the run's dtype measured at start), a preset ("h100", "h200", "a100"),
    or the path of a `shoal probe` JSON."""
    straggler_ratio: float = Field(1.2, gt=1)
    """A rank whose compute time since the last logged step is at least this many times the median of
    the other ranks' is named a straggler."""
    trace_steps: list[int] = []
    """[first, last]: write a torch.profiler trace of these steps (1-based, inclusive) to
    run_dir/traces, one file per rank (TensorBoard's profiler plugin or ui.perfetto.dev open it)."""

    @model_validator(mode="after")
    def _trace_steps(self) -> MetricsConfig:
        t = self.trace_steps
        if t and (len(t) != 2 or not 1 <= t[0] <= t[1]):
            raise ValueError(f"metrics.trace_steps = {t} must be [first, last] with 1 <= first <= last, "
                             f"e.g. [5, 7]")
        return self


class Config(Section):
    model: Any = None  # a model-specific Section, chosen by model.name (see load_config)
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    comm: CommConfig = CommConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _compatible(self) -> Config:
        needs = getattr(type(self.model), "data_kinds", None)
        kind = data_kind(self.data.source)
        if needs is not None and kind is not None and kind not in needs:
            sources = [s for s in DataSource.__args__ if data_kind(s) in needs]
            raise ValueError(
                f'model.name = "{self.model.name}" cannot train on data.source = "{self.data.source}"; '
                f"use data.source = {' or '.join(repr(s) for s in sources)}"
            )
        p, c = self.parallel, self.comm
        if p.sync == "parameter-server" and c.compression != "none":
            raise ValueError(f'comm.compression = "{c.compression}" is not applied to a parameter server\'s pushes; '
                             f'set comm.compression = "none"')
        if p.sync == "parameter-server" and self.train.on_bad_step == "rollback":
            raise ValueError('train.on_bad_step = "rollback" is not offered with parallel.sync = "parameter-server" '
                             '(the servers would have to reload too); use "skip" or "abort"')
        if c.compression != "none" and p.sync == "every-step" and (p.tp > 1 or p.pp > 1):
            raise ValueError(f'comm.compression = "{c.compression}" compresses the gradients of DDP and ZeRO 2/3 only, '
                             f"but parallel.tp = {p.tp}, pp = {p.pp} synchronise through FSDP2 replicate; set "
                             f'comm.compression = "none", or parallel.sync = "diloco" to compress its pseudo-gradient')
        if c.compression == "powersgd" and p.sync == "every-step" and p.zero >= 2:
            raise ValueError(f'comm.compression = "powersgd" needs whole matrices, but parallel.zero = {p.zero} '
                             f'reduce-scatters flat shards; use "int8", "topk", "fp16" or "bf16", or zero <= 1')
        if self.data.source in ("text", "tokens", "hf", "image-folder", "cifar10") and not self.data.path:
            raise ValueError(f'data.source = "{self.data.source}" needs data.path; set it to a file or folder')
        if self.data.source == "hf" and not self.data.tokenizer:
            raise ValueError('data.source = "hf" needs data.tokenizer; set it to a tokenizer.json file or a '
                             'tokenizer folder')
        return self

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.model_dump(by_alias=True)))


SECTIONS = {name: f.annotation for name, f in Config.model_fields.items() if name != "model"}


def data_kind(source: str) -> str | None:
    """The kind of batches a built-in source gives; None for a user's (known once it is built)."""
    if ":" in source:
        return None
    return {"synthetic-images": "images", "image-folder": "images", "cifar10": "images",
            "interactions": "interactions"}.get(source, "tokens")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or defaults), apply `section.key=value` overrides, validate, freeze."""
    origin = str(path) if path else "defaults"
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist; pass the path of a .toml file")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: not valid TOML: {e}") from None
    overridden = set()
    for item in overrides:
        key, value = _parse_override(item)
        section, _, field = key.partition(".")
        if not isinstance(raw.setdefault(section, {}), dict):
            raise UserError(f"{origin}: {section} must be a [section] table")
        raw[section][field] = value
        overridden.add(key)
    return validate_config(raw, origin, overridden)


def validate_config(raw: dict[str, Any], origin: str = "config", overridden: set[str] = frozenset()) -> Config:
    for section in raw:
        if section != "model" and section not in SECTIONS:
            raise UserError(f"{origin}: unknown section [{section}]{_suggest(section, ['model', *SECTIONS])}")
        if not isinstance(raw[section], dict):
            raise UserError(f"{origin}: {section} must be a [{section}] table, got {raw[section]!r}")

    def where(key: str) -> str:
        return "--set" if key in overridden else origin

    model_raw = dict(raw.get("model", {}))
    model_raw.setdefault("name", "gpt")
    try:
        model_cls = model_config_class(model_raw["name"])
        model = model_cls.model_validate(model_raw)
    except UserError as e:
        raise UserError(f"{where('model.name')}: {e}") from None
    except ValidationError as e:
        raise UserError(_explain(e, model_cls, ("model",), where)) from None
    try:
        return Config.model_validate({**{k: v for k, v in raw.items() if k != "model"}, "model": model})
    except ValidationError as e:
        raise UserError(_explain(e, Config, (), where)) from None


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or key.count(".") != 1 or not all(key.split(".")):
        raise UserError(f"--set {item!r}: expected section.key=value, for example --set train.steps=100")
    try:  # a TOML value (number, bool, quoted string, array); a bare word is taken as a string
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key, value


def _explain(err: ValidationError, cls: type[BaseModel], prefix: tuple, where) -> str:
    """Turn pydantic's first error into one line: origin, key, value, what is allowed."""
    e = err.errors()[0]
    loc = prefix + tuple(str(p) for p in e["loc"] if not isinstance(p, int))
    # a failing union member adds the member type to loc (e.g. ('parallel', 'dp', 'int')): drop it
    loc = tuple(p for p in loc if p not in ("int", "str", "float", "bool", "literal['auto']"))
    key = ".".join(loc)
    if e["type"] == "extra_forbidden":
        known = _fields_at(cls, loc[len(prefix):-1]) if prefix == () else list(cls.model_fields)
        section = ".".join(loc[:-1])
        return f"{where(key)}: unknown key {key}{_suggest(loc[-1], known, section + '.')}"
    msg = e["msg"].replace("Input should be", "must be").replace("Value error, ", "")
    if e["type"] == "value_error" and msg.startswith(tuple(f"{s}." for s in ("model", *SECTIONS))):
        return f"{where(msg.split(' ')[0])}: {msg}"
    value = e.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    return f"{where(key)}: {key}{shown}: {msg}"


def _fields_at(cls: type[BaseModel], path: tuple) -> list[str]:
    for part in path:
        ann = cls.model_fields[part].annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        cls = ann
    return [f.alias or name for name, f in cls.model_fields.items()]


def _suggest(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(choices)}"


def config_reference() -> str:
    """The config reference in Markdown, from the field docstrings above (docs/config.md is this)."""
    from shoal.models.registry import builtin_model_configs

    def table(cls: type[BaseModel], skip=("name",)) -> list[str]:
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, f in cls.model_fields.items():
            if name in skip:
                continue
            ann = str(f.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
            ann = ann.replace("|", "\\|")
            default = f.default_factory() if f.default_factory else f.default
            text = " ".join((f.description or "").split()).replace("|", "\\|")
            rows.append(f"| `{f.alias or name}` | `{ann}` | `{default!r}` | {text} |".replace("`None`", "unset"))
        return rows

    out = ["# Config reference", "",
           "Generated from the field docstrings in `src/shoal/config.py` and `src/shoal/models/`;",
           "`tests/unit/test_docs.py` fails when this page and the code disagree.", "",
           "## [model]", "", '`name` picks the model: a built-in name below, or `"package.module:function"` for '
           "your own (every other key in the section is passed to it).", ""]
    for name, cls in builtin_model_configs().items():
        out += [f'### name = "{name}"', "", (cls.__doc__ or "").strip(), "", *table(cls), ""]
    for name, cls in SECTIONS.items():
        out += [f"## [{name}]", "", *table(cls), ""]
    return "\n".join(out)


def _drop_none(d: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

"""[train], [precision], [checkpoint], [metrics]: the optimisation, the number format, what is saved and
what is measured."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from shoal.config.base import Section

# torch.compile's modes (its `mode` argument), by torch's names
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# the modes in which inductor records the compiled graphs as CUDA graphs and replays them (cudagraph trees)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_mode(compile: bool | str) -> str | None:
    """torch.compile's mode for a train.compile value; None: not compiled."""
    if compile is False:
        return None
    return "default" if compile is True else compile


class TrainConfig(Section):
    steps: int = Field(1000, ge=1)
    """Optimizer steps to run."""
    global_batch_size: int = Field(32, ge=1)
    """Samples per optimizer step, summed over all data-parallel ranks and accumulation steps."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per forward/backward on one rank, at most: a rank whose share of the global batch (global / dp)
    is smaller takes its share in one pass (so a config keeps its recipe on more GPUs); accumulation =
    share / micro."""
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
    compile: bool | CompileMode = False
    """torch.compile the model and its loss: true, or one of torch.compile's modes by its name ("default", the
    same as true; "reduce-overhead" and "max-autotune" capture CUDA graphs; "max-autotune-no-cudagraphs").
    The loss function is compiled over the wrapped model, so the loss and its fp32 upcast are in the compiled
    region; each pipeline stage is compiled on its own and its loss is not. CUDA graphs need the workers on
    CUDA and a step of fixed shapes and fixed parameter memory: not with parallel.pp > 1, zero 2/3 or
    balance.mode = "throughput". The first steps are slow (compiling); no speedup measured for small models
    on CPU."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """The (inner) optimizer: AdamW, or SGD with `momentum` (weight decay as for AdamW, added to the
    gradient). Under sync.mode = "local-sgd" / "diloco" it is what each replica steps with."""
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    """optimizer = "sgd": momentum (0: plain SGD)."""
    freeze: list[str] = []
    """Parameters left untouched: glob patterns over the model's parameter names (e.g.
    ["model.embed_tokens.*", "model.layers.0.*"]); they get no gradient and no optimizer state."""
    gc_interval: int = Field(50, ge=0)
    """Python's garbage collector during training, as torchtitan manages it (training/collector.py): automatic
    collection off, the heap frozen after the first steps, and a full collection between steps every this many
    steps, on every rank at the same step (0: Python's own automatic collection, which may pause any step on
    any rank)."""
    eval_on_start: bool = False
    """Validate once before the first step of a fresh start (summary.json: initial_val_*), e.g. to see
    what pretrained weights (model.init_from) score before fine-tuning."""

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_mode(cls, value):
        if isinstance(value, bool) or value in CompileMode.__args__:
            return value
        modes = ", ".join(f'"{m}"' for m in CompileMode.__args__)
        raise ValueError(f"train.compile = {value!r} must be true, false or one of torch.compile's modes: {modes}")

    @property
    def cuda_graphs(self) -> bool:
        """train.compile's mode captures CUDA graphs."""
        return compile_mode(self.compile) in CUDA_GRAPH_MODES



class PrecisionConfig(Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """Compute dtype under autocast; parameters and optimizer state stay fp32. "auto": bf16 on GPUs of compute
    capability 8.0 or newer, fp32 on the CPU and older GPUs (chosen where the config is loaded, said at start,
    stored in the run dir's config.toml). fp16 needs CUDA. fp8: linear
    layers in float8 (torchao, `pip install -e '.[fp8]'`), the rest in bf16; a GPU of compute capability 8.9 or
    newer (docs/gpus.md)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """ZeRO 2/3 with dtype bf16: parameters are gathered in bf16 and gradients reduced in this dtype
    (fp32: exact sums, twice the traffic)."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """dtype fp8: how each float8 cast is scaled (torchao's recipes). "tensorwise": one scale per tensor, the
    fastest in torchao's measurements, and it runs on Ada. "rowwise": one scale per row of each matmul operand,
    so that an outlier costs only its own row's precision; slower, and the weights are gathered in bf16."""
    fp8_all_gather: bool | Literal["auto"] = "auto"
    """dtype fp8 with parallel.zero 2/3: FSDP2 gathers the float8 layers' weights in float8 (one byte each, cast
    once per shard, their scales from one all-reduce after each step) instead of bf16. "auto": on with
    fp8_recipe "tensorwise"; torchao gathers in float8 with tensorwise scales only."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""

    @field_validator("fp8_all_gather", mode="before")
    @classmethod
    def _fp8_all_gather(cls, value):
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f'precision.fp8_all_gather = {value!r} must be true, false or "auto"')

    @model_validator(mode="after")
    def _fp8_all_gather_is_tensorwise(self) -> PrecisionConfig:
        if self.fp8_all_gather is True and self.fp8_recipe != "tensorwise":
            raise ValueError(f'precision.fp8_all_gather = true with precision.fp8_recipe = "{self.fp8_recipe}" is not '
                             f'supported (torchao gathers weights in float8 with one scale per tensor only); set '
                             f'fp8_all_gather = false or "auto", or fp8_recipe = "tensorwise"')
        return self

    def gathers_float8(self, zero: int) -> bool:
        """FSDP2 (parallel.zero = `zero`) gathers the float8 layers' weights in float8."""
        on = self.fp8_all_gather is True or (self.fp8_all_gather == "auto" and self.fp8_recipe == "tensorwise")
        return self.dtype == "fp8" and zero >= 2 and on


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
    sync.mode = "parameter-server" saves block (the servers write their state inside the workers' save)."""
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
    compute times, naming a straggler (docs/observability.md)."""
    peak: str = "auto"
    """Peak FLOP/s of one worker, for MFU: "auto" (a CUDA device's data-sheet preset found by its name,
    otherwise a short matmul in the run's dtype measured at start), a preset ("h100", "h200", "a100"),
    or the path of a `shoal probe` JSON."""
    straggler_ratio: float = Field(1.2, gt=1)
    """A rank whose compute time since the last logged step is at least this many times the median of
    the other ranks' is named a straggler."""
    host_syncs: bool = False
    """Count, step by step, the times the training thread made the host wait for the device (a GPU's
    synchronizing operations as torch's sync debug mode reports them; on the CPU, the reads of a value a GPU
    would wait for): each step's metrics get `host_syncs`, summary.json the median per step after the first
    (docs/observability.md). For looking, not timing: on the CPU it slows every operator."""
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


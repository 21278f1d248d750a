"""The whole run's config: every section, and the checks that span sections."""

from __future__ import annotations

from typing import Any

import tomli_w
from pydantic import model_validator

from shoal.config.base import Section
from shoal.config.data import DataConfig, DataSource, data_kind
from shoal.config.parallel import BalanceConfig, CommConfig, ParallelConfig, PSConfig, SyncConfig
from shoal.config.training import CheckpointConfig, MetricsConfig, PrecisionConfig, TrainConfig

# Sections and keys that choose how a run is laid out, computed or recorded, not what it trains: two
# configs that differ only here train the same model (`shoal parity` compares such pairs, and a run
# resumes across them)
LAYOUT_SECTIONS = ("parallel", "sync", "ps", "balance", "comm", "precision", "checkpoint", "metrics")
LAYOUT_KEYS = frozenset({"train.micro_batch_size", "train.compile", "data.cache_dir"})


class Config(Section):
    model: Any = None  # a model-specific Section, chosen by model.name (see load.py)
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    sync: SyncConfig = SyncConfig()
    ps: PSConfig = PSConfig()
    balance: BalanceConfig = BalanceConfig()
    comm: CommConfig = CommConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _compatible(self) -> Config:
        _check_data(self)
        _check_sync(self)
        _check_fragments(self)
        _check_compression(self)
        _check_cuda_graphs(self)
        return self

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.model_dump(by_alias=True)))


SECTIONS = {name: f.annotation for name, f in Config.model_fields.items() if name != "model"}


def _check_data(cfg: Config) -> None:
    d = cfg.data
    if d.streaming and d.source != "hf":
        raise ValueError(f'data.streaming = true reads a Hugging Face dataset as training goes (data.source = "hf"), '
                         f'not data.source = "{d.source}"; set data.source = "hf" with data.path and data.tokenizer')
    if d.streaming and (cfg.sync.mode == "parameter-server" or cfg.balance.mode != "uniform"):
        what = "sync.mode = \"parameter-server\"" if cfg.sync.mode == "parameter-server" else \
            f'balance.mode = "{cfg.balance.mode}"'
        raise ValueError(f"data.streaming = true gives each dp rank its own documents, which {what} does not "
                         f"draw from; set data.streaming = false")
    needs = getattr(type(cfg.model), "data_kinds", None)
    kind = data_kind(cfg.data.source)
    if needs is not None and kind is not None and kind not in needs:
        sources = [s for s in DataSource.__args__ if data_kind(s) in needs]
        raise ValueError(f'model.name = "{cfg.model.name}" cannot train on data.source = "{cfg.data.source}"; '
                         f"use data.source = {' or '.join(repr(s) for s in sources)}")
    if cfg.data.source in ("text", "tokens", "hf", "image-folder", "cifar10") and not cfg.data.path:
        raise ValueError(f'data.source = "{cfg.data.source}" needs data.path; set it to a file or folder')
    if cfg.data.source == "hf" and not cfg.data.tokenizer:
        raise ValueError('data.source = "hf" needs data.tokenizer; set it to a tokenizer.json file or a '
                         'tokenizer folder')


def _check_sync(cfg: Config) -> None:
    """[sync], [ps] and [balance] against the layout."""
    p, mode = cfg.parallel, cfg.sync.mode
    if mode != "every-step" and p.zero and not cfg.sync.replicas:
        raise ValueError(f'sync.mode = "{mode}" with parallel.zero = {p.zero}: a replica must span several dp ranks '
                         f"to be sharded over them; set sync.replicas (dp / replicas ranks per replica) or "
                         f"parallel.zero = 0")
    if mode == "parameter-server" and (p.tp > 1 or p.pp > 1 or p.zero):
        raise ValueError(f'sync.mode = "parameter-server" shards the model over the servers instead; set '
                         f"parallel.tp = 1, pp = 1 and zero = 0 (got tp {p.tp}, pp {p.pp}, zero {p.zero})")
    if mode == "parameter-server" and cfg.train.on_bad_step == "rollback":
        raise ValueError('train.on_bad_step = "rollback" is not offered with sync.mode = "parameter-server" '
                         '(the servers would have to reload too); use "skip" or "abort"')
    if cfg.balance.mode == "throughput" and (p.zero > 1 or p.tp > 1 or p.pp > 1 or mode != "every-step"):
        raise ValueError(f'balance.mode = "throughput" splits the batch unevenly over dp ranks that run DDP '
                         f'(parallel.zero 0/1, tp = 1, pp = 1, sync.mode = "every-step"); got zero {p.zero}, '
                         f'tp {p.tp}, pp {p.pp}, sync.mode "{mode}": set balance.mode = "uniform"')


def _check_fragments(cfg: Config) -> None:
    """The built-in GPT's blocks are known before launch (other models' are counted when the sync attaches,
    parallel/fragments.py; so are a pipeline stage's, which hold a share of them)."""
    blocks, fragments = getattr(cfg.model, "n_layer", None), cfg.sync.fragments
    if isinstance(blocks, int) and cfg.parallel.pp == 1 and blocks % fragments:
        raise ValueError(f"sync.fragments = {fragments} must divide the model's blocks (model.n_layer = {blocks}); "
                         f"set sync.fragments to a divisor of {blocks}")


def _check_compression(cfg: Config) -> None:
    p, c, mode = cfg.parallel, cfg.comm, cfg.sync.mode
    if mode == "parameter-server" and c.compression != "none":
        raise ValueError(f'comm.compression = "{c.compression}" is not applied to a parameter server\'s pushes; '
                         f'set comm.compression = "none"')
    if c.compression != "none" and mode == "every-step" and (p.tp > 1 or p.pp > 1):
        raise ValueError(f'comm.compression = "{c.compression}" compresses the gradients of DDP and ZeRO 2/3 only, '
                         f"but parallel.tp = {p.tp}, pp = {p.pp} synchronise through FSDP2 replicate; set "
                         f'comm.compression = "none", or sync.mode = "diloco" to compress its pseudo-gradient')
    if c.compression == "powersgd" and cfg.sync.fragment_delay:
        raise ValueError(f'comm.compression = "powersgd" needs a second round trip computed from the first, but '
                         f"sync.fragment_delay = {cfg.sync.fragment_delay} sends each fragment in one asynchronous "
                         f'collective; use "int8", "int4", "fp16", "bf16" or "topk", or fragment_delay = 0')
    if c.compression == "powersgd" and mode == "every-step" and p.zero >= 2:
        raise ValueError(f'comm.compression = "powersgd" needs whole matrices, but parallel.zero = {p.zero} '
                         f'reduce-scatters flat shards; use "int8", "topk", "fp16" or "bf16", or zero <= 1')


def _check_cuda_graphs(cfg: Config) -> None:
    """A CUDA graph replays one recorded step: the same kernels on the same shapes at the same addresses.
    Whether the workers are on CUDA is known with the layout (layout.py)."""
    t, p = cfg.train, cfg.parallel
    if not t.cuda_graphs:
        return
    graphs, fix = f'train.compile = "{t.compile}" captures CUDA graphs', "or train.compile = true (no CUDA graphs)"
    if p.pp > 1:
        raise ValueError(f"{graphs}, but parallel.pp = {p.pp}: a pipeline schedule keeps several micro-batches' "
                         f"forwards in flight before their backwards, and a replayed graph reuses its output memory; "
                         f"set parallel.pp = 1, {fix}")
    if p.zero >= 2:
        raise ValueError(f"{graphs}, but parallel.zero = {p.zero} (FSDP2) gathers and frees the parameters every "
                         f"step (zero 3 after every forward), which torch's CUDA graphs do not follow "
                         f"(pytorch#164264); set parallel.zero = 0 or 1, {fix}")
    if cfg.balance.mode == "throughput":
        raise ValueError(f'{graphs}, but balance.mode = "throughput" changes each rank\'s micro-batch size as the run '
                         f'goes (dynamic shapes: a graph recorded per size); set balance.mode = "uniform", {fix}')


def _drop_none(d: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

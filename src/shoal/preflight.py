"""One preflight for every way a run starts (`shoal train`, `shoal parity`, a worker launched by
torchrun, a Python caller): everything that can be checked is, before any worker trains.

    config -> layout for each world size the job may take (layout.py: pure); fp8: this machine's GPUs
           -> data source, and the model on the meta device (shapes only, no weights)
           -> does the model fit each layout (tensor-parallel sizes, pipeline split, validation set), and
              does one rank's model state fit its device (a GPU's memory, or the node's over its workers)
           -> run dir writable and large enough, checkpoint to resume compatible

Every refusal is a UserError: one line naming the key, the value and a fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.checkpoint.resume import check_compatible, checkpoint_bytes, find_resume_point
from shoal.checkpoint.train_state import read_train_state
from shoal.config import Config
from shoal.data.sources import build_source
from shoal.errors import UserError
from shoal.layout import Layout, resolve_layout
from shoal.models.keras import check_layout as check_keras_layout
from shoal.models.meta import on_meta
from shoal.models.pretrained import check_pretrained
from shoal.models.registry import RECORDED, build_model
from shoal.models.spec import ModelBundle, count_parameters
from shoal.parallel import float8
from shoal.parallel.experts import expert_blocks
from shoal.parallel.fit import (
    check_memory_fits,
    check_model_fits,
    check_shardable,
    check_whole_start,
    zero_shards,
)
from shoal.rundir import RunDir, check_writable
from shoal.training.build import freeze, unrecordable


@dataclass(frozen=True)
class Job:
    cfg: Config
    layouts: list[Layout]  # one per world size checked
    source: object  # the data source, built once (data/sources.py)
    n_params: int
    resume_from: Path | None = None  # the checkpoint the run would resume from (None: fresh)
    resume_step: int = 0  # its step

    @property
    def layout(self) -> Layout:
        return self.layouts[0]

    @property
    def finished(self) -> bool:
        """The run dir holds this run finished: its newest checkpoint is at train.steps or beyond."""
        return self.resume_from is not None and self.resume_step >= self.cfg.train.steps


def check_model_takes(cfg: Config, bundle: ModelBundle) -> None:
    """The model is one that parallel.ep, parallel.cp and data.pack_documents, where set, can split or pack."""
    if cfg.parallel.ep > 1:  # a model whose experts blocks parallel.ep can split
        expert_blocks(bundle.model, cfg.parallel.ep)
    if cfg.parallel.cp > 1 and not bundle.takes_positions:
        raise UserError(f"parallel.cp = {cfg.parallel.cp} splits each sequence over ranks, which model.name = "
                        f"\"{cfg.model.name}\" is not built for (its positions taken from the batch, its attention "
                        f"causal scaled_dot_product_attention: shoal's gpt and causal-lm hf models); set "
                        f"parallel.cp = 1")
    if cfg.data.pack_documents and not bundle.takes_positions:
        raise UserError(f"data.pack_documents restarts the positions at each document, which model.name = "
                        f"\"{cfg.model.name}\" does not take from the batch (shoal's gpt and causal-lm hf models do); "
                        f"set data.pack_documents = false")


def check_job(cfg: Config, world_sizes: list[int], cuda: bool, run_dir: Path | None = None,
              resume: str = "auto", quiet: bool = False, local_workers: int | None = None) -> Job:
    """Check `cfg` for every world size in `world_sizes` (and the run dir, when given). `local_workers`: the
    workers of this node, who share its memory (None: a CPU run's memory is not checked)."""
    layouts = [resolve_layout(cfg, w, cuda) for w in world_sizes]
    if cfg.precision.dtype == "fp8":  # this machine's GPUs and torchao (parallel/float8.py)
        float8.check(layouts[0].device)
    source = build_source(cfg.data, getattr(cfg.model, "seq_len", None), cfg.train.seed)
    with on_meta():
        bundle = build_model(cfg.model, source.spec)
    check_model_takes(cfg, bundle)
    for layout in layouts:
        check_fit(cfg, layout, bundle, source)
    freeze(bundle.model, cfg.train.freeze)  # frozen parameters have no gradients or optimizer state
    shapes: dict = {}  # the model's parameters and stages, measured once
    for layout in layouts:
        check_memory_fits(bundle, cfg, layout, local_workers, shapes)
    if local_workers and cfg.parallel.memory_check and may_start_whole(cfg.model.name, layouts):
        why = unrecordable(cfg.model, source.spec)
        if why:
            check_whole_start(bundle, why, local_workers)
    n_params = count_parameters(bundle.model)
    resume_from, resume_step = None, 0
    if run_dir is not None:
        check_writable(run_dir, checkpoint_bytes(cfg.checkpoint, n_params),
                       f"{cfg.checkpoint.keep} checkpoints kept + 1 being written, {n_params:,} parameters "
                       f"with AdamW state")
        resume_from = find_resume_point(RunDir(run_dir).checkpoints, resume, quiet=quiet)
        if resume_from is not None:
            resume_step = read_train_state(resume_from)["step"]
            check_compatible(cfg, resume_from)
    if resume_from is None and cfg.model.initial_weights():  # names and shapes, from the files' headers
        with on_meta():
            check_pretrained(build_model(cfg.model, source.spec, adapters=False).model, cfg.model.initial_weights())
    return Job(cfg, layouts, source, n_params, resume_from, resume_step)


def may_start_whole(model_name: str, layouts: list[Layout]) -> bool:
    """Is it worth recording the build here to learn whether every worker will build the model whole: a model
    not of shoal's own (whose builds always record, tests/unit/test_deferred.py), under a layout whose start
    would otherwise be sharded. A record that runs init functions on meta tensors imports torch's compiler
    stack (~1.3 s measured here, against 0.05 s for the preflight of gpt-tiny), which a launch pays only then."""
    sharded = any(zero_shards(lay) or lay.dims.tp > 1 or lay.dims.pp > 1 for lay in layouts)
    return sharded and model_name not in RECORDED


def check_fit(cfg: Config, layout: Layout, bundle: ModelBundle, source, memo: dict | None = None) -> None:
    """What the model and the data must satisfy for this layout (`memo`: parallel.fit's, across layouts)."""
    dims = layout.dims
    if source.num_val < layout.batch_ranks:  # (under parallel.cp a group's ranks share their samples)
        raise UserError(f"the validation split has {source.num_val} samples, fewer than dp ({layout.batch_ranks}); "
                        f"raise data.val_fraction")
    check_keras_layout(bundle.model, tp=dims.tp, pp=dims.pp, compile=cfg.train.compile,
                       activation_checkpointing=cfg.precision.activation_checkpointing)
    check_model_fits(bundle, cfg.model.name, cfg.parallel, cfg.precision, memo)
    check_shardable(bundle, layout)
    if dims.pp > 1 and cfg.checkpoint.final_weights and not cfg.checkpoint.enabled:
        raise UserError("with parallel.pp > 1 the final weights are exported from the final checkpoint: set "
                        "checkpoint.enabled = true, or checkpoint.final_weights = false")

"""Does a model fit a layout? Checked before any worker starts, on the meta device (only shapes are
looked at), and kept light: the launcher imports it without the strategies' libraries."""

from __future__ import annotations

from shoal.config import ParallelConfig, PrecisionConfig
from shoal.errors import UserError
from shoal.models.spec import ModelBundle
from shoal.parallel.pipeline import split_stages


def check_model_fits(bundle: ModelBundle, model_name: str, parallel: ParallelConfig,
                     precision: PrecisionConfig, memo: dict | None = None) -> None:
    """Refuse, before any worker starts, what parallelize() could not do for this model (on the meta
    device: only shapes are looked at). `memo`: answers kept per the keys they depend on, for one bundle
    asked of many layouts (shoal plan asks the same split for every ZeRO stage and micro-batch)."""
    if memo is None:
        return _check_model_fits(bundle, model_name, parallel, precision)
    p = parallel
    key = (p.tp, p.sequence_parallel, p.pp, p.pp_schedule, p.pp_stages_per_rank, repr(p.pp_split),
           precision.activation_checkpointing)
    if key not in memo:
        try:
            _check_model_fits(bundle, model_name, parallel, precision)
            memo[key] = None
        except UserError as e:
            memo[key] = str(e)
    if memo[key] is not None:
        raise UserError(memo[key])


def _check_model_fits(bundle: ModelBundle, model_name: str, parallel: ParallelConfig,
                      precision: PrecisionConfig) -> None:
    tp, pp = parallel.tp, parallel.pp
    if tp > 1:
        if bundle.tensor_parallel is None:
            raise UserError(f'parallel.tp = {tp}, but model "{model_name}" cannot be split by tensor parallelism '
                            f"(its ModelBundle.tensor_parallel is unset); set parallel.tp = 1")
        bundle.tensor_parallel(bundle.model, tp, sequence_parallel=parallel.sequence_parallel)  # sizes only
    if pp > 1:
        if bundle.pipeline is None:
            raise UserError(f'parallel.pp = {pp}, but model "{model_name}" cannot be split into pipeline stages '
                            f"(its ModelBundle.pipeline is unset); set parallel.pp = 1")
        layers = bundle.pipeline(bundle.model)
        split_stages(layers.names, layers.costs, pp, parallel.pp_schedule, parallel.pp_stages_per_rank,
                     parallel.pp_split)
    if precision.activation_checkpointing and not bundle.block_types:
        raise UserError(
            f'precision.activation_checkpointing = true, but model "{model_name}" names no blocks to '
            f"checkpoint (ModelBundle.block_types); set it to false"
        )

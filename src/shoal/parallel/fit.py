"""Does a model fit a layout? Checked before any worker starts, on the meta device (only shapes are
looked at), and kept light: the launcher imports it without the strategies' libraries."""

from __future__ import annotations

from shoal.config import ParallelConfig, PrecisionConfig
from shoal.errors import UserError
from shoal.models.spec import ModelBundle
from shoal.parallel.pipeline import split_stages


def check_model_fits(bundle: ModelBundle, model_name: str, parallel: ParallelConfig,
                     precision: PrecisionConfig) -> None:
    """Refuse, before any worker starts, what parallelize() could not do for this model (on the meta
    device: only shapes are looked at)."""
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

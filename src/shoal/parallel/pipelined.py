"""A model split into pipeline stages, as the training loop sees it (the same surface as
Parallelized): the step's micro-batches go through the schedule as one per-rank batch; a weight tied
across the first and last stage has its gradients added between the two and counts once in the
gradient norm, which is summed over the stages."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from shoal.models.spec import Batch
from shoal.parallel.clip import GradGroups, grad_norm, plain
from shoal.parallel.parallelized import Parallelized, Totals, add_to
from shoal.parallel.pipeline import Pipeline
from shoal.parallel.precision import Precision
from shoal.parallel.zero import reshard_all


class PipelinedModel(Parallelized):
    def __init__(self, *args, pipeline: Pipeline, stage_group, tied: list[torch.nn.Parameter], tie_group,
                 per_rank_batch: int, count_fn, pp: int, schedule: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.pipeline, self.stage_group, self.pp, self.schedule = pipeline, stage_group, pp, schedule
        self.tied, self.tie_group = tied, tie_group  # this rank's weights shared by the first and last stage
        self.per_rank_batch, self.count_fn = per_rank_batch, count_fn

    def describe(self) -> str:
        return self.pipeline.split.describe(self.pp, self.pipeline.microbatches, self.schedule)

    def forward_backward(self, batches: list[Batch], scale: Callable[[], torch.Tensor], precision: Precision,
                         backward_began: Callable[[], None] = lambda: None) -> torch.Tensor:
        """The schedule splits the per-rank batch into its micro-batches; the loss is known on the last
        stage only (zero elsewhere). The schedule interleaves forwards and backwards: the data thread's cue
        (`backward_began`) is given as it starts."""
        batches = [per_sample(b) for b in batches]
        whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        s = scale()
        backward_began()
        with self.loss_context(), precision.autocast(), self.attention({}):  # ({}: no packed documents)
            loss = plain(self.pipeline.run(whole, s))
        carried = self.pipeline.carried
        if carried is not None:  # the layers' losses of every stage, into the last stage's loss
            added = carried.taken(self.pipeline.microbatches, self.device)
            self.comm.all_reduce(added, group=self.stage_group, label="pp")
            if self.pipeline.last:
                loss = loss + added
        return loss.double()

    def after_backward(self) -> None:
        self._sync_tied()
        super().after_backward()

    def _sync_tied(self) -> None:
        """Add up the gradients of weights tied across the first and last stage, so both copies take the
        same step."""
        p = self.pipeline
        if self.tie_group is None or not (p.first or p.last):
            return
        for param in self.tied:
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # a vocab-parallel embedding's gradient comes back replicated: lay it out like the weight
                # (a local slice), so that both stages add tensors of the same shape
                param.grad = param.grad.redistribute(placements=param.placements)
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            self.comm.all_reduce(grad, group=self.tie_group, label="tied weights, first and last stage")

    def norm_params(self) -> list[tuple[torch.Tensor, bool]]:
        """A weight tied across stages counts on the first stage only."""
        skip = {id(p) for p in self.tied} if self.tie_group is not None and not self.pipeline.first else set()
        return [(p, id(p) not in skip) for p in self.model.parameters() if p.requires_grad]

    def _grad_norm(self, groups: GradGroups) -> torch.Tensor:
        return grad_norm(groups, self.comm, self.device, self.stage_group)  # summed over the stages

    def evaluate(self, share: torch.Tensor, longest: int, micro: int, val_batch: Callable[[torch.Tensor], Batch],
                 precision: Precision) -> Totals:
        """The validation loss of this rank's share, through the schedule (forward only). The schedule
        takes whole per-rank batches: a short share is padded with samples whose targets are -1, which
        the loss and the item count leave out."""
        batch = per_sample(self.shard(val_batch(share if len(share) else torch.zeros(1, dtype=torch.long))))
        if not len(share):
            batch["target"] = torch.full_like(batch["target"], -1)
        short = self.per_rank_batch - len(batch["target"])
        if short:
            pad = {k: v[:1].expand(short, *v.shape[1:]) for k, v in batch.items()}
            pad["target"] = torch.full_like(pad["target"], -1)
            batch = {k: torch.cat([batch[k], pad[k]]) for k in batch}
        with precision.autocast(), self.loss_context(), self.attention({}):
            loss = self.pipeline.run(batch, None)
        totals: Totals = {}
        add_to(totals, {"loss": (loss, self.count_fn(batch))})
        return totals

    def _reshard(self) -> None:
        for stage in self.pipeline.modules:
            reshard_all(stage)

    def whole_model(self, plain_model, is_main: bool) -> None:
        return None  # each rank holds some stages: the final checkpoint holds them all


def per_sample(batch: Batch) -> Batch:
    """`batch` with parallel.cp's positions (the rank's share of every sequence, (t,)) given to each sample, as the
    schedule splits the batch into micro-batches along the first dimension."""
    positions = batch.get("positions")
    if positions is None or positions.dim() == 2:
        return batch
    return {**batch, "positions": positions.expand(len(batch["input"]), -1)}

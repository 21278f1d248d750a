"""The model as one rank trains it, whatever the layout: the small surface the training loop uses.

parallelize() (apply.py) returns a Parallelized for a model that runs whole on each rank (plain, DDP,
ZeRO 1/2/3, tensor parallel and their data-parallel hybrids) or a PipelinedModel (pipelined.py) for
one split into stages. The loop asks it for: forward + backward of a step's micro-batches, what runs
after backward, the gradient norm (clipped), evaluation forwards, the optimizer, and whether this
rank's loss counts in the global loss; it never needs to know which wrapper holds the model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shoal.comm.collectives import Comm
from shoal.models.documents import DocumentAttention, packed_positions
from shoal.models.spec import Batch, ModelBundle
from shoal.parallel.clip import GradGroups, clip_grads, grad_norm, plain
from shoal.parallel.context import ContextParallel
from shoal.parallel.data import grad_sync, holds_sync
from shoal.parallel.precision import Precision
from shoal.parallel.sync import StepSync
from shoal.parallel.zero import reshard_all, shard_optimizer

Totals = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Parallelized:
    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, bundle: ModelBundle, *, comm: Comm,
                 sync: StepSync, device: torch.device, dp_rank: int, dp: int, dp_group, loss_context,
                 owns_loss: bool, sharded: bool, zero: int, zero_group=None, scales: Callable[[], None] | None = None,
                 expert_sync: Callable[[], None] | None = None, context: ContextParallel | None = None):
        self.model = model  # unwrapped, the whole model's names: optimizer, checkpoints, memory accounting
        self.module = module  # what forward runs on (DDP, FSDP2, compiled, or the model itself)
        self.loss_fn, self.eval_fn = bundle.loss_fn, bundle.eval_fn
        self.comm, self.sync, self.device = comm, sync, device
        self.dp_rank, self.dp, self.dp_group = dp_rank, dp, dp_group
        # parallel.cp: the dp ranks of a group train on the same sequences, each on its positions of them; the
        # batch is split over the groups (data_rank of data_ranks), the gradients reduced over every dp rank
        self.context = context
        cp = context.cp if context is not None else 1
        self.data_rank, self.data_ranks = dp_rank // cp, dp // cp
        self.zero_group = zero_group  # what ZeRO shards over: dp_group, or one replica's ranks (local SGD, DiLoCo)
        self.loss_context = loss_context  # tensor parallelism's context for the loss and its backward
        # this rank's loss sum enters the global loss (a tensor-parallel peer's copy of it does not)
        self.owns_loss = owns_loss
        self.sharded, self.zero = sharded, zero  # parameters sharded over dp: every rank runs every forward
        self.scales = scales  # collective: the float8 scales of the weights FSDP2 gathers in float8 (float8.py)
        self.expert_sync = expert_sync  # collective: parallel.ep's experts' gradients (parallel/experts.py)
        self._grad_groups: GradGroups | None = None
        # no context around a micro-batch: no gradient sync to hold back, no tensor-parallel loss (the two
        # context managers cost ~15 us of host time a micro-batch on a small model's step here)
        self._bare = not holds_sync(module) and loss_context is contextlib.nullcontext and context is None

    def describe(self) -> str | None:
        """What the start-up print adds about this layout (the pipeline's split), if anything."""
        return None

    def shard(self, batch: Batch) -> Batch:
        """What this rank computes of a batch its data rank was given: under parallel.cp its positions of each
        sequence (parallel/context.py), else all of it."""
        return batch if self.context is None else self.context.shard(batch)

    def attention(self, batch: Batch) -> contextlib.AbstractContextManager:
        """The context of `batch`'s forward (and backward): under parallel.cp, attention over the group's whole
        sequences; over packed documents (data.pack_documents), attention inside each document."""
        if self.context is not None:
            return self.context.attention(batch)
        positions = packed_positions(batch)
        return contextlib.nullcontext() if positions is None else DocumentAttention(positions)

    # --- training ---------------------------------------------------------------------------------

    def forward_backward(self, batches: list[Batch], scale: Callable[[], torch.Tensor], precision: Precision,
                         backward_began: Callable[[], None] = lambda: None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches, each backward scaled by `scale()` (asked
        after the first forward, so that computing it can overlap with that forward); `backward_began()` as
        the last backward starts. Returns the sum of the unscaled losses ([Note: loss contract])."""
        loss_sum: torch.Tensor | None = None
        for i, batch in enumerate(batches):
            began = backward_began if i == len(batches) - 1 else None
            if self._bare and "positions" not in batch:
                loss = self._forward_backward(batch, scale, precision, began)
            else:
                with grad_sync(self.module, self.sync.reduces(i, len(batches))), self.loss_context(), \
                        self.attention(batch):
                    loss = self._forward_backward(batch, scale, precision, began)
            # summed in float64; one micro-batch's loss as it is (its float64 value is the same number)
            part = loss.detach()
            loss_sum = part if loss_sum is None else loss_sum.double() + part.double()
        return torch.zeros((), dtype=torch.float64, device=self.device) if loss_sum is None else loss_sum

    def _forward_backward(self, batch: Batch, scale: Callable[[], torch.Tensor], precision: Precision,
                          began: Callable[[], None] | None) -> torch.Tensor:
        with precision.autocast():
            loss = plain(self.loss_fn(self.module, batch))
        if began is not None:
            began()
        precision.backward(loss, scale())
        return loss

    def after_backward(self) -> None:
        if self.expert_sync is not None:
            self.expert_sync()
        self.sync.after_backward()

    def after_step(self, step: int) -> None:
        """The optimizer stepped; `step` steps are done."""
        self.sync.after_step(step)
        if self.scales is not None:  # after the sync, which may have averaged the weights
            self.scales()

    def in_sync(self, step: int) -> bool:
        """Whether the dp replicas are one model once `step` steps are done."""
        return self.sync.in_sync(step)

    def skipped(self) -> None:
        """The optimizer skipped the step (a bad step)."""
        self.sync.skipped()

    def norm_params(self) -> list[tuple[torch.Tensor, bool]]:
        """The trained parameters, and whether each counts in the gradient norm."""
        return [(p, True) for p in self.model.parameters() if p.requires_grad]

    def grad_groups(self) -> GradGroups:
        """norm_params() grouped for the norm and the clip, once: they never change during a run."""
        if self._grad_groups is None:
            self._grad_groups = GradGroups(self.norm_params())
        return self._grad_groups

    def grad_norm(self) -> torch.Tensor:
        """The total norm of the gradients (every rank's share combined where the model is split)."""
        return self._grad_norm(self.grad_groups())

    def clip_grads(self, max_norm: float, norm: torch.Tensor) -> None:
        """Scale the gradients so that their total norm, `norm` (grad_norm()), is at most `max_norm`."""
        clip_grads(self.grad_groups(), max_norm, norm)

    def _grad_norm(self, groups: GradGroups) -> torch.Tensor:
        return grad_norm(groups, self.comm, self.device)

    def build_optimizer(self, groups: list[dict], optimizer_class: type[torch.optim.Optimizer],
                        **defaults) -> torch.optim.Optimizer:
        """The optimizer over `groups` of self.model's parameters; ZeRO 1 shards its state over dp."""
        if self.zero == 1:
            return shard_optimizer(groups, optimizer_class, self.zero_group, **defaults)
        return optimizer_class(groups, **defaults)

    # --- evaluation -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def evaluating(self):
        """Evaluation mode (no dropout, BatchNorm's running statistics) and, afterwards, sharded
        parameters freed: no backward follows to free what the forwards gathered."""
        was_training = self.model.training
        self.model.train(False)
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)
            if self.sharded:
                self._reshard()

    def _reshard(self) -> None:
        reshard_all(self.module)

    def evaluate(self, share: torch.Tensor, longest: int, micro: int, val_batch: Callable[[torch.Tensor], Batch],
                 precision: Precision) -> Totals:
        """Metric sums and counts over this rank's `share` of a validation batch (indices), in
        micro-batches. `longest`: the largest share any rank has. With sharded parameters every forward
        all-gathers, so a rank with a shorter share runs padding forwards whose results are dropped."""
        chunks = [c for c in share.split(micro) if len(c)]
        pad = math.ceil(longest / micro) - len(chunks) if self.sharded else 0
        totals: Totals = {}
        with precision.autocast(), self.loss_context():
            for _ in range(pad):  # results unused: only the collectives count
                self._evaluate(self.shard(val_batch(share[:1] if len(share) else torch.zeros(1, dtype=torch.long))))
            for chunk in chunks:
                add_to(totals, self._evaluate(self.shard(val_batch(chunk))))
        return totals

    def _evaluate(self, batch: Batch) -> Totals:
        with self.attention(batch):
            return self.eval_fn(self.module, batch)

    def holds_whole(self) -> bool:
        """Every rank holds the whole model as one process would (no shards, no DTensors)."""
        return not self.sharded and not any(isinstance(p, DTensor) for p in self.model.parameters())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model's state dict, gathered from the shards onto the CPU."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def whole_model(self, plain_model: Callable[[], torch.nn.Module], is_main: bool) -> torch.nn.Module | None:
        """Collective: the whole trained model on the main rank, as one process would hold it (the live
        module, or `plain_model()` loaded with the gathered shards); None elsewhere, and None everywhere
        when no rank holds the whole model (pipeline stages: the final checkpoint does)."""
        if self.holds_whole():
            return self.model if is_main else None
        full = self.full_state()
        if not is_main:
            return None
        model = plain_model()
        model.load_state_dict(full)
        return model


def add_to(totals: Totals, out: Totals) -> None:
    for k, (s, n) in out.items():
        acc = totals.setdefault(k, (torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)))
        acc[0].add_(plain(s).double().cpu())
        acc[1].add_(plain(n).double().cpu())

"""Step synchronisation: how the dp ranks' models stay one model, the seam between backward and the
optimizer step.

A StepSync decides which micro-batches reduce gradients in their backward, installs the
communication the data-parallel wrapper uses (DDP's comm hook, FSDP2's reduce-scatter), and may act
after backward and after the optimizer step; its state is checkpointed with the run
(checkpoint/train_state.py). EveryStep is data parallelism as DDP and FSDP do it. The seam admits,
without touching the training loop (docs/design.md, "The seams"):
  compression    EveryStep with a codec (comm/codecs.py) installed as DDP's comm hook (wrapped by
                 comm.hooks.logged) for ZeRO 0/1 and as FSDP2's reduce-scatter for ZeRO 2/3; its
                 error-feedback residuals are per-rank state (rank_state)
  local SGD /    PeriodicSync (local_sgd.py): no gradient traffic between replicas (no data-parallel wrapper,
  DiLoCo         or one within a replica's ranks); after_step() averages every H steps, DiLoCo through an outer
                 optimizer
  parameter      PushPull (ps/worker.py): no wrapper; after_backward() pushes gradients to the server
  server         ranks, the worker's optimizer pulls the new parameters; server ranks run ps/sync_server.py
State comes in two kinds: state_dict() is JSON shared by every rank (train_state.json); rank_state() is
tensors that differ per rank (residuals, a replica's own parameters), saved in each rank's own file.
Whatever the mode, decisions every rank must share (stop, bad step, checkpoint due) ride on the one
flags all-reduce of each step (training/flags.py), which does not depend on gradients being synchronised.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.nn.parallel import DistributedDataParallel as DDP

from shoal.comm.codecs import Codec, DDPState
from shoal.comm.hooks import logged
from shoal.comm.lent_buffer import LentBuffer
from shoal.comm.log import CollectiveLog
from shoal.comm.model_waits import log_fsdp_all_gathers


class StepSync(Protocol):
    name: str
    # the mode must know at a step's end whether its update was skipped (it undoes the step's codec state,
    # or syncs only after steps that ran): the step then reads its verdict on the host at once
    verdict_at_once: bool

    def install(self, module: torch.nn.Module, dp_group, log: CollectiveLog) -> None:
        """Set up the wrapped module's gradient communication (called once per wrapped module)."""

    def attach(self, model: torch.nn.Module, dp_group, dp: int) -> None:
        """This rank's whole model (every stage it holds), once, after wrapping."""

    def reduces(self, index: int, count: int) -> bool:
        """Whether micro-batch `index` of a step's `count` reduces gradients over dp in its backward."""

    def in_sync(self, step: int) -> bool:
        """Whether the replicas are one model once `step` steps are done: where a live run may change its
        group at a step's end (live/generation.py)."""

    def after_backward(self) -> None:
        """The step's gradients are complete on this rank."""

    def after_step(self, step: int) -> None:
        """The optimizer has stepped; `step` steps are done."""

    def skipped(self) -> None:
        """The step's update was skipped (a bad step): undo what its backward changed in this state."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def rank_state(self) -> dict[str, torch.Tensor]:
        """Tensors that differ per rank, for this rank's checkpoint file."""

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """This rank's saved tensors; None when there are none for it (another world size and no
        merge_rank_states, or a checkpoint of another sync mode): start them afresh from the restored model.
        A mode may also offer merge_rank_states(states, world): this rank's tensors on another world size
        from the old world's ranks' (checkpoint/train_state.py)."""


class EveryStep:
    """Gradients averaged over dp in the backward of every step's last micro-batch: all-reduced by
    DDP or FSDP2 replicate, reduce-scattered by ZeRO 2/3, overlapped with the backward; compressed
    by `codec` (DDP's comm hook, FSDP2's custom reduce-scatter)."""

    name = "every-step"

    @property
    def verdict_at_once(self) -> bool:
        return self.codec.feedback  # a skipped step's residuals are undone

    def __init__(self, codec: Codec):
        self.codec = codec
        # the codec's state at the last completed step: a step's backward changes the codec's residuals
        # bucket by bucket, so a step that fails or is skipped midway leaves them part new, part old
        self.held: dict[str, torch.Tensor] = {}
        self.buffer = LentBuffer()  # ZeRO 2/3 on CPU: lent to the all-gather outputs and reduce-scatter inputs

    def install(self, module: torch.nn.Module, dp_group, log: CollectiveLog) -> None:
        if isinstance(module, DDP):  # in the collective log, whatever the codec
            names = {id(p): n for n, p in module.module.named_parameters()}
            module.register_comm_hook(DDPState(dp_group, names), logged(self.codec.ddp_hook, log, "dp"))
        else:
            log_fsdp_all_gathers(module, log, self.buffer)  # the parameters' all-gathers, in the log as well
            for name, m in module.named_modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(CodecReduceScatter(self.codec, name or "root", self.buffer))

    def attach(self, model: torch.nn.Module, dp_group, dp: int) -> None:
        pass

    def reduces(self, index: int, count: int) -> bool:
        return index == count - 1

    def in_sync(self, step: int) -> bool:
        return True

    def after_backward(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        # references, not copies: a codec replaces its tensors each step and never changes them in place
        self.held = self.codec.state_tensors()

    def skipped(self) -> None:
        self.codec.load_state_tensors(self.held)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rank_state(self) -> dict[str, torch.Tensor]:
        return self.held

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        self.codec.load_state_tensors(tensors or {})
        self.held = self.codec.state_tensors()

    def merge_rank_states(self, states: list[dict[str, torch.Tensor]], world: int) -> dict[str, torch.Tensor]:
        return self.codec.merge_state_tensors(states, world)


class CodecReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter for one FSDP module, through a codec (FSDP2 calls it
    synchronously, async_op False, with the flat padded gradients of the module's parameters laid out
    rank by rank). FSDP2 asks it for that input and then for the output, the shard that becomes the
    gradients; the input may borrow `buffer` (comm/lent_buffer.py) once its size is known."""

    def __init__(self, codec: Codec, key: str, buffer: LentBuffer | None = None):
        self.codec, self.key, self.buffer = codec, key, buffer
        self.sizes: tuple[int, int] | None = None  # (input, output) numels, from the first call

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.buffer is not None and self.sizes is not None and self.sizes[0] != self.sizes[1] \
                and math.prod(size) == self.sizes[0]:
            lent = self.buffer.lend(size, dtype, device)
            if lent is not None:
                return lent
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):
        self.codec.reduce_scatter(output_tensor, input_tensor, group, op, self.key, f"dp, gradients of {self.key}")
        self.sizes = (input_tensor.numel(), output_tensor.numel())
        if self.buffer is not None and self.buffer.holds(input_tensor):
            self.buffer.give_back()  # reduced: on CPU FSDP2 reads the input no more
        return None

"""Step synchronisation: how the dp ranks' models stay one model, the seam between backward and the
optimizer step.

A StepSync decides which micro-batches reduce gradients in their backward, installs the
communication the data-parallel wrapper uses (DDP's comm hook, FSDP2's reduce-scatter), and may act
after backward and after the optimizer step; its state is checkpointed with the run
(checkpoint/train_state.py). EveryStep is data parallelism as DDP and FSDP do it. The seam admits,
without touching the training loop (docs/design.md, "Sync modes"):
  compression    a codec inside install(): a DDP comm hook (wrapped by comm.hooks.logged) for ZeRO 0/1,
                 FSDPModule.set_custom_reduce_scatter for ZeRO 2/3; error-feedback residuals in state_dict
  local SGD /    reduces() always False (no gradient traffic); after_step() averages the parameters every
  DiLoCo         H steps, DiLoCo through an outer optimizer whose state is in state_dict
  parameter      reduces() False; after_backward() pushes gradients to the server ranks and pulls fresh
  server         parameters; server ranks run a serve loop instead of training
Whatever the mode, decisions every rank must share (stop, bad step, checkpoint due) ride on the one
flags all-reduce of each step (train/flags.py), which does not depend on gradients being synchronised.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from shoal.comm.hooks import logged
from shoal.comm.log import CollectiveLog


class StepSync(Protocol):
    name: str

    def install(self, module: torch.nn.Module, dp_group, log: CollectiveLog) -> None:
        """Set up the wrapped module's gradient communication (called once per wrapped module)."""

    def reduces(self, index: int, count: int) -> bool:
        """Whether micro-batch `index` of a step's `count` reduces gradients over dp in its backward."""

    def after_backward(self) -> None:
        """The step's gradients are complete on this rank."""

    def after_step(self, step: int) -> None:
        """The optimizer has stepped; `step` steps are done."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EveryStep:
    """Gradients averaged over dp in the backward of every step's last micro-batch: all-reduced by
    DDP or FSDP2 replicate, reduce-scattered by ZeRO 2/3, overlapped with the backward."""

    name = "every-step"

    def install(self, module: torch.nn.Module, dp_group, log: CollectiveLog) -> None:
        if isinstance(module, DDP):  # torch's averaging all-reduce, in the collective log
            module.register_comm_hook(dp_group, logged(allreduce_hook, log, "dp"))

    def reduces(self, index: int, count: int) -> bool:
        return index == count - 1

    def after_backward(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

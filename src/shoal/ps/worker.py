"""A parameter-server worker's side, synchronous: its model, its step synchronisation and its optimizer.

The last `ps.servers` ranks serve (sync_server.py), the others train with the model whole and unwrapped
(ServedModel). One step, on every worker:

  backward -> after_backward (PushPull): worker 0 sends each server a SyncHeader STEP; every worker
              sends each server the gradients of the tensors it owns (one flat fp32 message, or by rows:
              wire.py), then receives the total gradient norm from server 0 (the servers add their
              shards' squares)
  the loop's flags and bad-step verdict, as in every mode
  optimizer.step() (RemoteOptimizer) -> worker 0 sends each server Control(apply, lr of each group);
              every worker receives the new parameters of each server's tensors, into its model
  a skipped step -> at zero_grad(), worker 0 sends Control(drop): the servers drop the step's gradients
  a checkpoint -> before_save (SyncWorker, strategies.py): worker 0 sends SAVE once the checkpoint's
              folder exists; the servers join the DCP save (over all ranks) with the optimizer state of
              their tensors, the workers with the parameters: the checkpoint is an ordinary one (any
              layout resumes it), and a resumed server loads its state from it the same way
  end of training -> finish: worker 0 sends DONE, the servers leave their loop

A server divides each worker's gradient by their number and sums them in rank order (DDP divides
before its all-reduce too; only the order of the sum differs), clips by the total norm as torch's
clip_grads_with_norm_ does, and steps AdamW with the learning rate worker 0's schedule gave: the same
arithmetic as every-step data parallelism up to rounding (tests/dist/test_param_server.py). The
transport is c10d point-to-point on the run's backend (gloo across hosts: it runs wherever the
collectives run, and each send is logged for the hang report); everything a step needs is known in
advance, so no RPC layer is needed. The model, the servers' shards and their arithmetic are on each
rank's device; the messages on the device the backend's send and recv take (wire.message_device: the
GPU under NCCL, the host under gloo).
"""

from __future__ import annotations

import contextlib

import torch

from shoal.comm.collectives import Comm
from shoal.models.spec import ModelBundle
from shoal.parallel.parallelized import Parallelized
from shoal.ps.messages import Control, Kind, SyncHeader
from shoal.ps.shards import shard_names
from shoal.ps.wire import Wire, sparse_tables


class PushPull:
    """The step synchronisation of a synchronous parameter-server worker (a StepSync): gradients
    pushed after backward, parameters pulled when the step applies."""

    name = "parameter-server"
    verdict_at_once = True

    def __init__(self, comm: Comm, server_ranks: list[int], is_first: bool, device: torch.device,
                 messages: torch.device, sparse: bool = False):
        """`device`: this rank's (the model's); `messages`: where its messages to the servers are made
        (wire.message_device, links.DEVICE)."""
        self.comm, self.server_ranks, self.is_first, self.sparse = comm, server_ranks, is_first, sparse
        self.device, self.messages = device, messages
        self.shards: list[list[torch.Tensor]] = []
        self.wires: list[Wire] = []
        self.groups = 0  # parameter groups: the learning rates each control message carries
        self.norm = torch.zeros((), dtype=torch.float64, device=device)
        self.pulled_bytes = 0  # bytes received from the servers, since the start (sent: comm.sync_bytes)

    def attach(self, model: torch.nn.Module, dp_group, dp: int) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params, tables = dict(named), sparse_tables(model) if self.sparse else set()
        owned = shard_names(named, len(self.server_ranks))
        self.shards = [[params[n] for n in names] for names in owned]
        self.wires = [Wire(shard, [n in tables for n in names], self.messages)
                      for shard, names in zip(self.shards, owned, strict=True)]

    def install(self, module: torch.nn.Module, dp_group, log) -> None:
        pass  # no data-parallel wrapper: the servers reduce

    def reduces(self, index: int, count: int) -> bool:
        return index == count - 1

    def after_backward(self) -> None:
        sends = self.header(Kind.STEP)
        for rank, wire in zip(self.server_ranks, self.wires, strict=True):
            sends += self.push(rank, wire)
        for s in sends:
            s.wait()
        norm = self.comm.recv(torch.empty((), dtype=torch.float64, device=self.messages), self.server_ranks[0],
                              "ps norm")
        self.norm = norm.to(self.device)  # the loop's flags and verdict read it beside the model's tensors

    def after_step(self, step: int) -> None:
        pass

    def in_sync(self, step: int) -> bool:
        return True

    def skipped(self) -> None:
        pass  # the servers are told in skip()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def push(self, to, wire: Wire) -> list:
        """This step's gradients of a server's tensors (of its tables, the touched rows), to global rank
        `to` (or over the link `to`)."""
        grads = [p.grad for p in wire.params]
        channel, dst = (self.comm, to) if isinstance(to, int) else (to, None)
        sends, nbytes = wire.send(channel, dst, grads, wire.touched(grads), "ps gradients")
        self.comm.sync_bytes += nbytes
        return sends

    def header(self, kind: Kind, step: int = 0) -> list:
        """Worker 0 tells every server what follows; returns the sends to wait for."""
        if not self.is_first:
            return []
        msg = SyncHeader(kind, step).tensor(self.messages)
        return [self.comm.send(msg, rank, "ps header") for rank in self.server_ranks]

    @torch.no_grad()
    def pull(self) -> None:
        """The servers' new parameters, into this worker's model."""
        for rank, wire in zip(self.server_ranks, self.wires, strict=True):
            self.pull_from(rank, wire)

    def pull_from(self, frm, wire: Wire) -> None:
        """A server's new parameters, from global rank `frm` (or over the link `frm`), into the model."""
        channel, src = (self.comm, frm) if isinstance(frm, int) else (frm, None)
        flat, rows, nbytes = wire.recv(channel, src, "ps parameters")
        wire.load(flat, rows)
        self.pulled_bytes += nbytes

    def control(self, apply: bool, lrs: list[float]) -> None:
        """Worker 0 tells the servers whether the step's update applies, with each group's learning rate."""
        if self.is_first:
            msg = Control(apply, lrs).tensor(self.messages)
            for s in [self.comm.send(msg, rank, "ps control") for rank in self.server_ranks]:
                s.wait()

    def update(self, lrs: list[float]) -> None:
        """The step's update applies: the servers step, the workers pull."""
        self.control(True, lrs)
        self.pull()

    def skip(self, lrs: list[float]) -> None:
        """The step was not taken (a bad step): the servers drop its gradients."""
        self.control(False, lrs)

    def before_save(self, step: int) -> None:
        """Worker 0 calls the servers into the checkpoint of `step` (they write the optimizer state)."""
        for s in self.header(Kind.SAVE, step):
            s.wait()

    def finish(self) -> None:
        for s in self.header(Kind.DONE):
            s.wait()

    def step_metrics(self) -> dict:
        return {"pulled_bytes_total": self.pulled_bytes}


class RemoteOptimizer(torch.optim.Optimizer):
    """The worker's optimizer: its param groups carry the learning rate the schedule sets; stepping
    asks the servers to apply the update and pulls the result. Every step ends with zero_grad(), where
    a step that was not taken (a bad step) is reported as skipped. It holds no state: the servers do."""

    def __init__(self, groups: list[dict], sync: PushPull, **defaults):
        super().__init__(groups, defaults)
        self.sync, self._told = sync, False
        sync.groups = len(self.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        self.sync.update([g["lr"] for g in self.param_groups])
        self._told = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._told:
            self.sync.skip([g["lr"] for g in self.param_groups])
        self._told = False
        super().zero_grad(set_to_none=set_to_none)


class ServedModel(Parallelized):
    """A parameter-server worker's model: whole, unwrapped; the servers reduce, clip and step."""

    def __init__(self, model: torch.nn.Module, bundle: ModelBundle, sync: PushPull, *, comm: Comm,
                 device: torch.device, dp_rank: int, dp: int):
        super().__init__(model, model, bundle, comm=comm, sync=sync, device=device, dp_rank=dp_rank, dp=dp,
                         dp_group=None, loss_context=contextlib.nullcontext, owns_loss=True, sharded=False, zero=0)
        self.push_pull = sync

    def describe(self) -> str:
        held = ", ".join(f"server {s}: {len(p)} tensors, {sum(x.numel() for x in p):,} parameters"
                         for s, p in enumerate(self.push_pull.shards))
        return f"parameter servers ({held})"

    def grad_norm(self) -> torch.Tensor:
        """The total norm the servers computed (synchronous) or this worker did (asynchronous)."""
        return self.push_pull.norm

    def clip_grads(self, max_norm: float, norm: torch.Tensor) -> None:
        pass  # the servers clip

    def build_optimizer(self, groups: list[dict], optimizer_class: type[torch.optim.Optimizer],
                        **defaults) -> torch.optim.Optimizer:
        return RemoteOptimizer(groups, self.push_pull, lr=defaults["lr"])

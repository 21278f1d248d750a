"""A central parameter server, synchronous: the worker's side and the wire both sides speak.

The last `ps.servers` ranks serve (train/serve.py), the others train. Parameters and their
optimizer state are sharded over the servers by whole tensors, balanced by bytes (`shard_names`:
largest first, each to the server holding the fewest bytes so far), so a server steps ordinary
AdamW on ordinary tensors. One step, on every worker:

  backward -> after_backward: worker 0 sends each server a header (1: a step follows); every worker
              sends each server the gradients of the tensors it owns (one flat fp32 message), then
              receives the total gradient norm from server 0 (the servers add their shards' squares)
  the loop's flags and bad-step verdict, as in every mode
  optimizer.step() (RemoteOptimizer) -> worker 0 sends each server [1, lr of each group]; every worker
              receives the new parameters of each server's tensors, into its model
  a skipped step -> at zero_grad(), worker 0 sends [0, ...]: the servers drop the step's gradients
  a checkpoint -> before_save(): worker 0 sends the header [2, step] once the checkpoint's folder
              exists; the servers join the DCP save (over all ranks) with the optimizer state of their
              tensors, the workers with the parameters: the checkpoint is an ordinary one (any layout
              resumes it), and a resumed server loads its state from it the same way
  end of training -> finish(): worker 0 sends the header 0, the servers leave their loop

A server divides each worker's gradient by their number and sums them in rank order (DDP divides
before its all-reduce too; only the order of the sum differs), clips by the total
norm as torch's clip_grads_with_norm_ does, and steps AdamW with the learning rate worker 0's schedule
gave: the same arithmetic as every-step data parallelism up to rounding (tests/dist/test_param_server.py).
The transport is c10d point-to-point on the run's backend (gloo across hosts: it runs wherever the
collectives run, and each send is logged for the hang report); everything a step needs is known in
advance, so no RPC layer is needed for the synchronous mode.
"""

from __future__ import annotations

import contextlib

import torch

from shoal.comm.collectives import Comm
from shoal.models.spec import ModelBundle
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.ps_wire import Wire, sparse_tables

HEADER_DONE, HEADER_STEP, HEADER_SAVE = 0.0, 1.0, 2.0  # a header: [what follows, its step]


def shard_names(named: list[tuple[str, torch.Tensor]], servers: int) -> list[list[str]]:
    """Which server owns which tensor: whole tensors, balanced by bytes (largest first, to the server
    with the fewest bytes so far; ties to the lower index), each server's names in model order."""
    order = {n: i for i, (n, _) in enumerate(named)}
    load, owned = [0] * servers, [[] for _ in range(servers)]
    for name, p in sorted(named, key=lambda x: (-x[1].numel() * x[1].element_size(), order[x[0]])):
        s = min(range(servers), key=lambda i: (load[i], i))
        load[s] += p.numel() * p.element_size()
        owned[s].append(name)
    return [sorted(names, key=order.get) for names in owned]


class PushPull:
    """The step synchronisation of a parameter-server worker: gradients pushed after backward."""

    name = "parameter-server"

    def __init__(self, comm: Comm, server_ranks: list[int], is_first: bool, sparse: bool = False):
        self.comm, self.server_ranks, self.is_first, self.sparse = comm, server_ranks, is_first, sparse
        self.shards: list[list[torch.Tensor]] = []
        self.wires: list[Wire] = []
        self.norm = torch.zeros((), dtype=torch.float64)
        self.pulled_bytes = 0  # bytes received from the servers, since the start (sent: comm.sync_bytes)

    def attach(self, model: torch.nn.Module, dp_group, dp: int) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params, tables = dict(named), sparse_tables(model) if self.sparse else set()
        owned = shard_names(named, len(self.server_ranks))
        self.shards = [[params[n] for n in names] for names in owned]
        self.wires = [Wire(shard, [n in tables for n in names])
                      for shard, names in zip(self.shards, owned, strict=True)]

    def push(self, to, wire: Wire) -> list:
        """This step's gradients of a server's tensors (of its tables, the touched rows), to global rank
        `to` (or over the link `to`)."""
        grads = [p.grad for p in wire.params]
        channel, dst = (self.comm, to) if isinstance(to, int) else (to, None)
        sends, nbytes = wire.send(channel, dst, grads, wire.touched(grads), "ps gradients")
        self.comm.sync_bytes += nbytes
        return sends

    def install(self, module: torch.nn.Module, dp_group, log) -> None:
        pass  # no data-parallel wrapper: the servers reduce

    def reduces(self, index: int, count: int) -> bool:
        return index == count - 1

    def header(self, kind: float, step: int = 0) -> list:
        """Worker 0 tells every server what follows; returns the sends to wait for."""
        if not self.is_first:
            return []
        msg = torch.tensor([kind, step], dtype=torch.float64)
        return [self.comm.send(msg, rank, "ps header") for rank in self.server_ranks]

    def after_backward(self) -> None:
        sends = self.header(HEADER_STEP)
        for rank, wire in zip(self.server_ranks, self.wires, strict=True):
            sends += self.push(rank, wire)
        for s in sends:
            s.wait()
        self.norm = self.comm.recv(torch.zeros((), dtype=torch.float64), self.server_ranks[0], "ps norm")

    def after_step(self, step: int) -> None:
        pass

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
            msg = torch.tensor([1.0 if apply else 0.0, *lrs], dtype=torch.float64)
            for s in [self.comm.send(msg, rank, "ps control") for rank in self.server_ranks]:
                s.wait()

    def update(self, lrs: list[float]) -> None:
        """The step's update applies: the servers step, the workers pull."""
        self.control(True, lrs)
        self.pull()

    def skip(self, lrs: list[float]) -> None:
        """The step was not taken (a bad step): the servers drop its gradients."""
        self.control(False, lrs)

    def finish(self) -> None:
        for s in self.header(HEADER_DONE):
            s.wait()

    def before_save(self, step: int) -> None:
        for s in self.header(HEADER_SAVE, step):
            s.wait()

    def step_metrics(self) -> dict:
        return {"pulled_bytes_total": self.pulled_bytes}

    def report(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class RemoteOptimizer(torch.optim.Optimizer):
    """The worker's optimizer: its param groups carry the learning rate the schedule sets; stepping
    asks the servers to apply the update and pulls the result. Every step ends with zero_grad(), where
    a step that was not taken (a bad step) is reported as skipped."""

    def __init__(self, groups: list[dict], sync, **defaults):
        super().__init__(groups, defaults)
        self.sync, self._told = sync, False
        sync.groups = len(self.param_groups)  # the learning rates each message carries

    @torch.no_grad()
    def step(self, closure=None):
        self.sync.update([g["lr"] for g in self.param_groups])
        self._told = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._told:
            self.sync.skip([g["lr"] for g in self.param_groups])
        self._told = False
        super().zero_grad(set_to_none=set_to_none)

    def forget(self) -> None:
        """Drop this step's gradients without a word to the servers: its links broke (what was sent died
        with them, and the unit is dealt again)."""
        self._told = False
        super().zero_grad(set_to_none=True)


class ServedModel(Parallelized):
    """A parameter-server worker's model: whole, unwrapped; the servers reduce, clip and step."""

    def __init__(self, model: torch.nn.Module, bundle: ModelBundle, sync, *, comm: Comm,
                 device: torch.device, dp_rank: int, dp: int):
        super().__init__(model, model, bundle, comm=comm, sync=sync, device=device, dp_rank=dp_rank, dp=dp,
                         dp_group=None, loss_context=contextlib.nullcontext, owns_loss=True, sharded=False, zero=0)
        self.push_pull = sync

    def describe(self) -> str:
        held = ", ".join(f"rank {r}: {len(s)} tensors, {sum(p.numel() for p in s):,} parameters"
                         for r, s in zip(self.push_pull.server_ranks, self.push_pull.shards, strict=True))
        return f"parameter servers ({held})"

    def clip_grad_norm(self, max_norm: float, before_clip=lambda norm: None) -> torch.Tensor:
        """The total norm the servers computed; they clip."""
        norm = self.push_pull.norm
        before_clip(norm)
        return norm

    def build_optimizer(self, groups: list[dict], optimizer_class: type[torch.optim.Optimizer],
                        **defaults) -> torch.optim.Optimizer:
        return RemoteOptimizer(groups, self.push_pull, lr=defaults["lr"])

    def finish(self) -> None:
        self.push_pull.finish()

    def before_save(self, step: int) -> None:
        self.push_pull.before_save(step)

    def step_metrics(self) -> dict:
        return self.push_pull.step_metrics()

    def report(self) -> dict:
        return self.push_pull.report()

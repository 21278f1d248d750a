"""Which server owns which tensors, and a server's shard: those tensors, their optimizer, and what each
worker has not pulled yet.

Parameters and their optimizer state are sharded over the servers by whole tensors, balanced by bytes
(`shard_names`: largest first, each to the server holding the fewest bytes so far), so a server steps
ordinary AdamW on ordinary tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from shoal.checkpoint.tensors import tensor_state
from shoal.comm.collectives import Comm
from shoal.config import PSConfig, TrainConfig
from shoal.models.spec import DataSpec, ModelSection
from shoal.ps.wire import Wire, sparse_tables
from shoal.training.build import build_on
from shoal.training.optim import optimizer_groups


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


class Shard:
    """The tensors server `index` owns (whole tensors of the model, shard_names) and their optimizer."""

    def __init__(self, model: ModelSection, train: TrainConfig, ps: PSConfig, spec: DataSpec, index: int, init: bool,
                 device: torch.device, messages: torch.device):
        """`device`: this rank's, where the shard and its optimizer live; `messages`: where its messages are made
        (wire.message_device, links.DEVICE)."""
        torch.manual_seed(train.seed)  # the workers' initial weights: computed on the CPU, as their start does
        self.model = build_on(model, spec, init=init).model.to(device)
        self.device = device
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = dict(named)
        names = shard_names(named, ps.servers)[index]
        self.params = [params[n] for n in names]
        if not self.params:
            raise RuntimeError(f"parameter server {index} owns no tensor: use fewer servers than the model has "
                               f"tensors")
        tables = sparse_tables(self.model) if ps.sparse else set()
        self.wire = Wire(self.params, [n in tables for n in names], messages)
        # per worker, per table: the rows that changed since that worker's last pull
        self.stale_rows: dict[int, list[torch.Tensor]] = {}
        self.held: list[torch.Tensor] | None = None  # async: gradients waiting to be aggregated
        optimizer_class, groups, hyper = optimizer_groups(self.params, train)
        self.optimizer = optimizer_class(groups, **hyper)
        self.numel = sum(p.numel() for p in self.params)
        self.max_norm = train.grad_clip or math.inf

    def track(self, workers: list[int]) -> None:
        """Workers that start with the initial parameters (the synchronous mode's)."""
        self.stale_rows = {w: [torch.zeros(t.shape[0], dtype=torch.bool, device=t.device) for t in self.wire.tables]
                           for w in workers}

    def track_worker(self, w: int) -> None:
        """A worker that joins: its first pull takes every row."""
        self.stale_rows[w] = [torch.ones(t.shape[0], dtype=torch.bool, device=t.device) for t in self.wire.tables]

    def recv_grads(self, comm, w: int) -> torch.Tensor:
        """Worker `w`'s push (over `comm`: the job's Comm, or a link), as the dense flat gradient of this shard."""
        flat, rows, _ = self.wire.recv(comm, w, "ps gradients")
        return self.wire.dense_grad(flat, rows)

    def send_values(self, comm, w: int) -> list:
        """The parameters, to worker `w` (of the tables, the rows that changed since its last pull)."""
        rows = None
        if self.wire.tables:
            rows = [m.nonzero().squeeze(1) for m in self.stale_rows[w]]
            for m in self.stale_rows[w]:
                m.zero_()
        return self.wire.send(comm, w, self.params, rows, "ps parameters")[0]

    def set_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def clip(self, norm: torch.Tensor) -> None:
        """The gradients set, clipped by `norm` (the whole update's norm) as torch's clip_grads_with_norm_ does."""
        torch.nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm.float())

    def hold(self) -> None:
        """Add the gradients set to those held for the next aggregated step."""
        if self.held is None:
            self.held = [p.grad for p in self.params]
        else:
            for h, p in zip(self.held, self.params, strict=True):
                h += p.grad

    def set_held(self, count: int) -> None:
        """The mean of the `count` held gradients, as the gradients to apply."""
        for h, p in zip(self.held, self.params, strict=True):
            p.grad = h if count == 1 else h / count
        self.held = None

    def apply(self, lrs: list[float], norm: torch.Tensor | None = None) -> None:
        """One optimizer step with the gradients set (clipped by `norm` first, if given), at the learning
        rates the workers' schedule gave."""
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        if norm is not None:
            self.clip(norm)
        before = [t.clone() for t in self.wire.tables]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for i, (old, t) in enumerate(zip(before, self.wire.tables, strict=True)):
            changed = t.ne(old).reshape(t.shape[0], -1).any(dim=1)
            for masks in self.stale_rows.values():
                masks[i] |= changed

    def save(self, tmp: Path, comm: Comm) -> None:
        """Collective with the workers' save: this server's optimizer state (they write the parameters)."""
        with comm.record("dcp.save", "world, parameter server's optimizer state"):
            dcp.save(tensor_state(self.model, self.optimizer, with_model=False), storage_writer=FileSystemWriter(tmp))

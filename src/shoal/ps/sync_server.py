"""A synchronous parameter server's loop (ps.mode = "sync"): one step at a time, with every worker.

Per step (the protocol is worker.py's): the header from worker 0; every worker's gradients of this
server's tensors; their mean; the total norm (the servers add their shards' squares); worker 0's
Control; the update and the new parameters to every worker. A SAVE header calls the server into the
workers' checkpoint with its optimizer state; DONE ends the loop.
"""

from __future__ import annotations

import torch

from shoal.checkpoint.manifest import step_dir_name
from shoal.comm.collectives import Comm
from shoal.ps.messages import Control, Kind, SyncHeader
from shoal.ps.shards import Shard
from shoal.rundir import RunDir


class SyncServer:
    def __init__(self, shard: Shard, run: RunDir, index: int, workers: list[int], server_group, comm: Comm):
        """`workers`: their global ranks; `server_group`: the servers' group (None: this server is alone)."""
        self.shard, self.run, self.index, self.workers = shard, run, index, workers
        self.server_group, self.comm = server_group, comm
        self.steps = self.applied = self.saves = 0

    def serve(self) -> dict:
        """Until worker 0 says training is over; returns what this server did."""
        at = self.shard.wire.messages
        while True:
            header = SyncHeader.read(self.comm.recv(torch.empty(SyncHeader.SIZE, dtype=torch.float64, device=at),
                                                    self.workers[0], "ps header"))
            if header.kind == Kind.DONE:
                break
            if header.kind == Kind.SAVE:
                self.shard.save(self.run.checkpoints / (step_dir_name(header.step) + ".tmp"), self.comm)
                self.saves += 1
            else:
                self.step()
        return {"steps": self.steps, "applied": self.applied, "saves": self.saves}

    def step(self) -> None:
        shard, comm, workers = self.shard, self.comm, self.workers
        grads = [shard.recv_grads(comm, w) for w in workers]
        # each divided by n, then summed in rank order: DDP's order of operations (it divides before
        # its all-reduce), so the rounding differs from data parallelism only in the sum's order
        n = len(workers)
        mean = grads[0] / n
        for g in grads[1:]:
            mean += g / n
        shard.set_grads(mean)
        squares = torch.nn.utils.get_total_norm([p.grad for p in shard.params]).double() ** 2
        if self.server_group is not None:
            comm.all_reduce(squares, group=self.server_group, label="ps servers, gradient norm")
        norm = squares.sqrt()
        at = shard.wire.messages
        if self.index == 0:
            sent = norm.to(at)
            for s in [comm.send(sent, w, "ps norm") for w in workers]:
                s.wait()
        groups = len(shard.optimizer.param_groups)
        control = Control.read(comm.recv(torch.empty(Control.size(groups), dtype=torch.float64, device=at),
                                         workers[0], "ps control"))
        self.steps += 1
        if control.apply:
            shard.apply(control.lrs, norm)
            self.applied += 1
            for s in [s for w in workers for s in shard.send_values(comm, w)]:
                s.wait()
        else:
            shard.optimizer.zero_grad(set_to_none=True)

"""A parameter server's loop (sync.mode = "parameter-server"): the tensors this server owns, their
optimizer state, and the workers' messages (the protocols: parallel/param_server.py for ps_mode =
"sync", parallel/ps_async.py for "async"). A server starts from the run's newest checkpoint, as its
workers do, and writes its optimizer state into every checkpoint they write."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from shoal.checkpoint.manager import load_checkpoint
from shoal.checkpoint.manifest import step_dir_name
from shoal.checkpoint.resume import find_resume_point
from shoal.checkpoint.tensors import tensor_state
from shoal.comm.collectives import Comm
from shoal.config import Config
from shoal.parallel.param_server import HEADER_DONE, HEADER_SAVE, shard_names
from shoal.parallel.ps_async import staleness_bins
from shoal.parallel.ps_wire import Wire, sparse_tables
from shoal.rundir import RunDir
from shoal.training.build import build_on
from shoal.training.optim import optimizer_groups
from shoal.training.serve_async import serve_async
from shoal.training.serve_checkpoint import ServerCheckpoints, ServerState


class Shard:
    """The tensors one server owns (whole tensors of the model, shard_names) and their optimizer."""

    def __init__(self, cfg: Config, spec, index: int, init: bool):
        torch.manual_seed(cfg.train.seed)  # the workers' initial weights
        self.model = build_on(cfg.model, spec, init=init).model
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = dict(named)
        names = shard_names(named, cfg.ps.servers)[index]
        self.params = [params[n] for n in names]
        tables = sparse_tables(self.model) if cfg.ps.sparse else set()
        self.wire = Wire(self.params, [n in tables for n in names])
        # per worker, per table: the rows that changed since that worker's last pull
        self.stale_rows: dict[int, list[torch.Tensor]] = {}
        self.held: list[torch.Tensor] | None = None  # async: gradients waiting to be aggregated
        if not self.params:
            raise RuntimeError(f"parameter server {index} owns no tensor: use fewer servers than the model has "
                               f"tensors")
        optimizer_class, groups, hyper = optimizer_groups(self.params, cfg.train)
        self.optimizer = optimizer_class(groups, **hyper)
        self.numel = sum(p.numel() for p in self.params)
        self.max_norm = cfg.train.grad_clip or math.inf

    def track(self, workers: list[int]) -> None:
        """Workers that start with the initial parameters (the synchronous mode's)."""
        self.stale_rows = {w: [torch.zeros(t.shape[0], dtype=torch.bool) for t in self.wire.tables] for w in workers}

    def track_worker(self, w: int) -> None:
        """A worker that joins: its first pull takes every row."""
        self.stale_rows[w] = [torch.ones(t.shape[0], dtype=torch.bool) for t in self.wire.tables]

    def recv_grads(self, comm: Comm, w: int) -> torch.Tensor:
        """Worker `w`'s push, as the dense flat gradient of this shard."""
        flat, rows, _ = self.wire.recv(comm, w, "ps gradients")
        return self.wire.dense_grad(flat, rows)

    def send_values(self, comm: Comm, w: int) -> list:
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


def serve(cfg: Config, spec, index: int, workers: list[int], server_group, comm: Comm, run_dir: Path,
          resume: str = "auto", store=None) -> dict:
    """Serve shard `index` until every worker is done; returns what this server did. `server_group`: the
    servers' group when they share a job with the workers (None: the servers' job is theirs alone, and
    `store` the one the roles meet in: ps_launch.py)."""
    run = RunDir(run_dir)
    # the workers' first agreement too (run_training): the same checkpoint on every rank
    resume_path = comm.agree("resume_from", lambda: str(find_resume_point(run.checkpoints, resume) or ""))
    shard = Shard(cfg, spec, index, init=not resume_path)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if cfg.ps.mode == "sync":
        shard.track(workers)
        if resume_path:  # collective with the workers' load: they take the parameters, this server its state
            load_checkpoint(Path(resume_path), shard.model, shard.optimizer, comm)
        with torch.no_grad():
            done = serve_sync(shard, run, index, workers, server_group if cfg.ps.servers > 1 else None, comm)
    else:  # the servers alone load and save (serve_checkpoint.py)
        mine = comm if server_group is None else Comm(comm.store, index, cfg.ps.servers, comm.log,
                                                      group=server_group)
        state = ServerState(len(workers), staleness_bins(len(workers), cfg.ps.max_staleness))
        saver = ServerCheckpoints(shard, index, cfg, mine, run, len(workers), state)
        if resume_path:
            units = saver.resume(Path(resume_path), server_group)
            state.people.setdefault("resumed", []).append({"checkpoint": resume_path, "units": units})
            say(f"parameter server {index}: resumed from {resume_path} (every unit before {units} applied, "
                f"version {state.version})")
        with torch.no_grad():
            done = serve_async(shard, cfg, index, len(workers), comm, store or comm.store, saver, say)
    return {"server": index, "tensors": len(shard.params), "parameters": shard.numel, **done,
            "resumed_from": resume_path or None}


def serve_sync(shard: Shard, run: RunDir, index: int, workers: list[int], server_group, comm: Comm) -> dict:
    n, steps, applied, saves = len(workers), 0, 0, 0
    while True:
        kind, step = comm.recv(torch.zeros(2, dtype=torch.float64), workers[0], "ps header").tolist()
        if kind == HEADER_DONE:
            break
        if kind == HEADER_SAVE:
            shard.save(run.checkpoints / (step_dir_name(int(step)) + ".tmp"), comm)
            saves += 1
            continue
        grads = [shard.recv_grads(comm, w) for w in workers]
        # each divided by n, then summed in rank order: DDP's order of operations (it divides before
        # its all-reduce), so the rounding differs from data parallelism only in the sum's order
        mean = grads[0] / n
        for g in grads[1:]:
            mean += g / n
        shard.set_grads(mean)
        squares = torch.nn.utils.get_total_norm([p.grad for p in shard.params]).double() ** 2
        if server_group is not None:
            comm.all_reduce(squares, group=server_group, label="ps servers, gradient norm")
        norm = squares.sqrt()
        if index == 0:
            for s in [comm.send(norm, w, "ps norm") for w in workers]:
                s.wait()
        control = comm.recv(torch.zeros(1 + len(shard.optimizer.param_groups), dtype=torch.float64), workers[0],
                            "ps control")
        steps += 1
        if control[0].item() == 1.0:
            shard.apply(control[1:].tolist(), norm)
            applied += 1
            for s in [s for w in workers for s in shard.send_values(comm, w)]:
                s.wait()
        else:
            shard.optimizer.zero_grad(set_to_none=True)
    return {"steps": steps, "applied": applied, "saves": saves}

"""A parameter server's loop (parallel.sync = "parameter-server"): the tensors this server owns, their
optimizer state, and the workers' messages (the protocols: parallel/param_server.py for ps_mode =
"sync", parallel/ps_async.py for "async"). A server starts from the run's newest checkpoint, as its
workers do, and writes its optimizer state into every checkpoint they write."""

from __future__ import annotations

import math
import time
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
from shoal.parallel.param_server import HEADER_DONE, HEADER_SAVE, HEADER_STEP, shard_names
from shoal.parallel.ps_async import staleness_bins
from shoal.parallel.ps_wire import Wire, sparse_tables
from shoal.rundir import RunDir
from shoal.train.build import build_on
from shoal.train.optim import optimizer_groups


class Shard:
    """The tensors one server owns (whole tensors of the model, shard_names) and their optimizer."""

    def __init__(self, cfg: Config, spec, index: int, init: bool):
        torch.manual_seed(cfg.train.seed)  # the workers' initial weights
        self.model = build_on(cfg.model, spec, init=init).model
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = dict(named)
        names = shard_names(named, cfg.parallel.servers)[index]
        self.params = [params[n] for n in names]
        tables = sparse_tables(self.model) if cfg.parallel.ps_sparse else set()
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
        self.stale_rows = {w: [torch.zeros(t.shape[0], dtype=torch.bool) for t in self.wire.tables] for w in workers}

    def recv_grads(self, comm: Comm, w: int) -> torch.Tensor:
        """Worker `w`'s push, as the dense flat gradient of this shard."""
        (flat,), rows, _ = self.wire.recv(comm, w, "ps gradients")
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
          resume: str = "auto") -> dict:
    """Serve shard `index` until every worker is done; returns what this server did."""
    run = RunDir(run_dir)
    # the workers' first agreement too (run_training): the same checkpoint on every rank
    resume_path = comm.agree("resume_from", lambda: str(find_resume_point(run.checkpoints, resume) or ""))
    shard = Shard(cfg, spec, index, init=not resume_path)
    shard.track(workers)
    if resume_path:  # collective with the workers' load: they take the parameters, this server its state
        load_checkpoint(Path(resume_path), shard.model, shard.optimizer, comm)
    with torch.no_grad():
        if cfg.parallel.ps_mode == "async":
            done = serve_async(shard, cfg, index, workers, comm)
        else:
            done = serve_sync(shard, run, index, workers, server_group, comm)
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


def serve_async(shard: Shard, cfg: Config, index: int, workers: list[int], comm: Comm) -> dict:
    """Apply each worker's update on arrival; reply with the new parameters (and, server 0, the next
    unit of data) unless the worker is more than max_staleness updates ahead of the slowest live worker
    (stale-synchronous parallel, Ho et al. 2013): then its reply waits until the slowest catches up."""
    n, k, groups = len(workers), cfg.parallel.max_staleness, len(shard.optimizer.param_groups)
    total_units, next_unit = n * cfg.train.steps, n  # worker w starts with unit w
    live, clock = set(workers), dict.fromkeys(workers, 0)
    since = dict.fromkeys(workers, 0)  # the largest staleness applied since the worker's last reply
    held: list[int] = []
    outbox: list = []  # replies in flight
    hist = torch.zeros(staleness_bins(n, k), dtype=torch.float64)
    version, started = 0, time.perf_counter()
    aggregate = cfg.parallel.ps_aggregate
    waiting: list[int] = []  # the pulled versions of the updates held for the next step
    newest_lrs: list[float] = []

    def reply(w: int) -> None:
        nonlocal next_unit
        unit = -1
        if index == 0 and w in live:
            unit, next_unit = (next_unit if next_unit < total_units else -1), next_unit + 1
        meta = torch.tensor([version, since[w], unit], dtype=torch.float64)
        since[w] = 0
        # not waited for here: a worker reads its servers' replies in turn, and may be held by another
        # server, so waiting would tie this server to that one
        outbox.extend([comm.send(meta, w, "ps version"), *shard.send_values(comm, w)])
        for s in [s for s in outbox if s.work.is_completed()]:
            s.wait()  # done: closes its record in the collective log
            outbox.remove(s)

    def step() -> None:
        """Apply the held updates (their mean, at the newest one's learning rates); each one's staleness
        is counted."""
        nonlocal version
        shard.set_held(len(waiting))
        shard.apply(newest_lrs)
        for pulled in waiting:
            staleness = version - pulled
            hist[min(staleness, len(hist) - 1)] += 1
            for u in since:
                since[u] = max(since[u], staleness)
        waiting.clear()
        version += 1

    def release() -> None:
        slowest = min((clock[u] for u in live), default=0)
        for w in [w for w in held if clock[w] - slowest <= k]:
            held.remove(w)
            reply(w)

    while live:
        header = torch.zeros(4 + groups, dtype=torch.float64)
        w = comm.recv_any(header, "ps header")
        kind, _unit, pulled, norm, *lrs = header.tolist()
        if kind == HEADER_DONE:
            live.discard(w)
            release()
            continue
        if kind == HEADER_STEP:
            shard.set_grads(shard.recv_grads(comm, w))
            shard.clip(torch.tensor(norm, dtype=torch.float64))  # each update clipped as a whole
            shard.hold()
            waiting.append(int(pulled))
            newest_lrs = lrs
            if len(waiting) == aggregate:
                step()
        clock[w] += 1
        held.append(w)
        release()
    if waiting:  # the last few updates, fewer than parallel.ps_aggregate
        step()
    applied = int(hist.sum().item())
    reply(workers[0])  # the final parameters
    account = torch.cat([torch.tensor([applied, time.perf_counter() - started], dtype=torch.float64), hist])
    outbox.append(comm.send(account, workers[0], "ps account"))
    for s in outbox:
        s.wait()
    return {"applied": applied, "staleness_max": max((s for s, c in enumerate(hist.tolist()) if c), default=0)}

"""A rank's part in a parameter-server run (sync.mode = "parameter-server"): serving or training.

In one job (ps.mode = "sync", or "async" in a harness or across nodes) the last ps.servers ranks serve
and the others train, on a group of their own (their collectives never wait for a server); an
asynchronous worker's world is itself alone. In the asynchronous roles' separate jobs (roles.py), a
process knows its role from its environment and meets the others in server 0's store.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from shoal.checkpoint.manager import load_checkpoint
from shoal.checkpoint.resume import find_resume_point
from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.config import Config
from shoal.dist import DistEnv
from shoal.layout import Layout
from shoal.ps import links, roles
from shoal.ps.async_server import AsyncServer
from shoal.ps.checkpoints import ServerCheckpoints, ServerState
from shoal.ps.messages import staleness_bins
from shoal.ps.shards import Shard
from shoal.ps.strategies import AsyncWorker, SyncWorker
from shoal.ps.sync_server import SyncServer
from shoal.ps.wire import message_device
from shoal.rundir import RunDir
from shoal.training.train import run_training


def run_job(cfg: Config, layout: Layout, source, run_dir: Path, env: DistEnv, comm: Comm, *, resume: str = "auto",
            phase: Phase | None = None) -> dict:
    """This rank's part: serve (the last layout.servers ranks) or train. Returns the summary (a server:
    what it served)."""
    n, asynchronous = layout.dims.world_size, cfg.ps.mode == "async"
    role = roles.role()
    if role:  # each role a job of its own (roles.py): they meet in server 0's store
        store = roles.open_store(role == "server" and env.rank == 0, cfg.parallel.timeout_s)
        if role == "server":
            return serve(cfg, source.spec, env.rank, comm, run_dir, workers=list(range(n)), server_group=None,
                         device=env.device, backend=layout.backend, resume=resume, store=store)
        slot = int(os.environ[roles.SLOT])  # the slot is the worker's rank in the run
        strategy = AsyncWorker(cfg, layout, env.device, slot, comm, source=source, store=store,
                               reopen=lambda: roles.open_store(False, cfg.parallel.timeout_s))
        return run_training(cfg, layout, source, run_dir, dataclasses.replace(env, rank=slot), comm, resume=resume,
                            phase=phase, strategy=strategy)
    workers = comm.new_group(list(range(n)))  # collective: every rank creates every group
    servers = comm.new_group(list(range(n, n + layout.servers)))
    # asynchronous: each worker's collectives (its step's flags, its validation) are its own
    alone = [comm.new_group([w]) for w in range(n)] if asynchronous else None
    if env.rank >= n:
        return serve(cfg, source.spec, env.rank - n, comm, run_dir, workers=list(range(n)), server_group=servers,
                     device=env.device, backend=layout.backend, resume=resume)
    world = comm.within(alone[env.rank], 1) if alone else comm.within(workers, n)
    env = dataclasses.replace(env, world_size=world.world_size)
    if asynchronous:
        strategy = AsyncWorker(cfg, layout, env.device, env.rank, world, source=source, store=comm.store)
    else:
        strategy = SyncWorker(cfg, layout, env.device, env.rank, world)
    return run_training(cfg, layout, source, run_dir, env, world, resume=resume, phase=phase, strategy=strategy)


def serve(cfg: Config, spec, index: int, comm: Comm, run_dir: Path, *, workers: list[int], server_group,
          device: torch.device, backend: str, resume: str = "auto", store=None) -> dict:
    """Serve shard `index` until every worker is done; returns what this server did. `server_group`: the
    servers' group when they share a job with the workers (None: the servers' job is theirs alone, and
    `store` the one the roles meet in); `device`: this rank's, where the shard lives; `backend`: the job's."""
    run = RunDir(run_dir)
    # the workers' first agreement too (training/run.py): the same checkpoint on every rank
    resume_path = comm.agree("resume_from", lambda: str(find_resume_point(run.checkpoints, resume) or ""))
    # synchronous: over the job's process group; asynchronous: over the links
    messages = message_device(device, backend) if cfg.ps.mode == "sync" else links.DEVICE
    shard = Shard(cfg.model, cfg.train, cfg.ps, spec, index, init=not resume_path, device=device, messages=messages)
    if cfg.ps.mode == "sync":
        shard.track(workers)
        if resume_path:  # collective with the workers' load: they take the parameters, this server its state
            load_checkpoint(Path(resume_path), shard.model, shard.optimizer, comm)
        with torch.no_grad():
            done = SyncServer(shard, run, index, workers, server_group if cfg.ps.servers > 1 else None, comm).serve()
    else:  # the servers alone load and save (checkpoints.py)
        done = serve_async(cfg, shard, index, comm, run, workers=len(workers), server_group=server_group,
                           resume_path=resume_path, store=store or comm.store)
    return {"server": index, "tensors": len(shard.params), "parameters": shard.numel, **done,
            "resumed_from": resume_path or None}


def serve_async(cfg: Config, shard: Shard, index: int, comm: Comm, run: RunDir, *, workers: int, server_group,
                resume_path: str, store) -> dict:
    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    mine = comm if server_group is None else Comm(comm.store, index, cfg.ps.servers, comm.log, group=server_group)
    state = ServerState(workers, staleness_bins(workers, cfg.ps.max_staleness))
    saver = ServerCheckpoints(shard, index, cfg, mine, run, workers, state)
    if resume_path:
        units = saver.resume(Path(resume_path), server_group)
        state.people.setdefault("resumed", []).append({"checkpoint": resume_path, "units": units})
        say(f"parameter server {index}: resumed from {resume_path} (every unit before {units} applied, "
            f"version {state.version})")
    with torch.no_grad():
        return AsyncServer(shard, cfg.ps, index, comm, workers=workers, steps=cfg.train.steps,
                           timeout_s=cfg.parallel.timeout_s, store=store, saver=saver, say=say).serve()

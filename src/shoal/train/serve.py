"""A parameter server's loop (parallel.sync = "parameter-server"): the tensors this server owns,
their AdamW state, and one step per message from the workers (the protocol is in
parallel/param_server.py). A server starts from the run's newest checkpoint, as its workers do, and
writes its optimizer state into every checkpoint they write."""

from __future__ import annotations

import math
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
from shoal.rundir import RunDir
from shoal.train.build import build_on
from shoal.train.optim import optimizer_groups


def serve(cfg: Config, spec, index: int, workers: list[int], server_group, comm: Comm, run_dir: Path,
          resume: str = "auto") -> dict:
    """Serve shard `index` until worker 0 says the run is done; returns what this server did."""
    run = RunDir(run_dir)
    # the workers' first agreement too (run_training): the same checkpoint on every rank
    resume_path = comm.agree("resume_from", lambda: str(find_resume_point(run.checkpoints, resume) or ""))
    torch.manual_seed(cfg.train.seed)  # the workers' initial weights
    model = build_on(cfg.model, spec, init=not resume_path).model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = dict(named)
    mine = [params[n] for n in shard_names(named, cfg.parallel.servers)[index]]
    if not mine:
        raise RuntimeError(f"parameter server {index} owns no tensor: use fewer servers than the model has tensors")
    optimizer_class, groups, hyper = optimizer_groups(mine, cfg.train)
    optimizer = optimizer_class(groups, **hyper)
    if resume_path:  # collective with the workers' load: they take the parameters, this server its state
        load_checkpoint(Path(resume_path), model, optimizer, comm)
    n, numel = len(workers), sum(p.numel() for p in mine)
    max_norm = cfg.train.grad_clip or math.inf
    steps = applied = saves = 0
    with torch.no_grad():
        while True:
            kind, step = comm.recv(torch.zeros(2, dtype=torch.float64), workers[0], "ps header").tolist()
            if kind == HEADER_DONE:
                break
            if kind == HEADER_SAVE:  # the workers write the parameters, this server its tensors' state
                tmp = run.checkpoints / (step_dir_name(int(step)) + ".tmp")
                with comm.record("dcp.save", "world, parameter server's optimizer state"):
                    dcp.save(tensor_state(model, optimizer, with_model=False), storage_writer=FileSystemWriter(tmp))
                saves += 1
                continue
            grads = [comm.recv(torch.empty(numel), w, "ps gradients") for w in workers]
            mean = grads[0]
            for g in grads[1:]:  # in rank order: the same sum every time
                mean += g
            mean /= n
            offset = 0
            for p in mine:
                p.grad = mean[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            squares = torch.nn.utils.get_total_norm([p.grad for p in mine]).double() ** 2
            if server_group is not None:
                comm.all_reduce(squares, group=server_group, label="ps servers, gradient norm")
            norm = squares.sqrt()
            if index == 0:
                for s in [comm.send(norm, w, "ps norm") for w in workers]:
                    s.wait()
            control = comm.recv(torch.zeros(1 + len(optimizer.param_groups), dtype=torch.float64), workers[0],
                                "ps control")
            steps += 1
            if control[0].item() == 1.0:
                for group, lr in zip(optimizer.param_groups, control[1:].tolist(), strict=True):
                    group["lr"] = lr
                torch.nn.utils.clip_grads_with_norm_(mine, max_norm, norm.float())
                optimizer.step()
                applied += 1
                flat = torch.cat([p.reshape(-1) for p in mine])
                for s in [comm.send(flat, w, "ps parameters") for w in workers]:
                    s.wait()
            optimizer.zero_grad(set_to_none=True)
    return {"server": index, "tensors": len(mine), "parameters": numel, "steps": steps, "applied": applied,
            "saves": saves, "resumed_from": resume_path or None}

"""A parameter server's loop (parallel.sync = "parameter-server"): the tensors this server owns,
their AdamW state, and one step per message from the workers (the protocol is in
parallel/param_server.py)."""

from __future__ import annotations

import math

import torch

from shoal.comm.collectives import Comm
from shoal.config import Config
from shoal.parallel.param_server import HEADER_DONE, shard_names
from shoal.train.build import build_on
from shoal.train.optim import optimizer_groups


def serve(cfg: Config, spec, index: int, workers: list[int], server_group, comm: Comm) -> dict:
    """Serve shard `index` until worker 0 says the run is done; returns what this server did."""
    torch.manual_seed(cfg.train.seed)  # the workers' initial weights
    model = build_on(cfg.model, spec, init=True).model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = dict(named)
    mine = [params[n] for n in shard_names(named, cfg.parallel.servers)[index]]
    if not mine:
        raise RuntimeError(f"parameter server {index} owns no tensor: use fewer servers than the model has tensors")
    optimizer_class, groups, hyper = optimizer_groups(mine, cfg.train)
    optimizer = optimizer_class(groups, **hyper)
    n, numel = len(workers), sum(p.numel() for p in mine)
    max_norm = cfg.train.grad_clip or math.inf
    steps = applied = 0
    with torch.no_grad():
        while True:
            header = comm.recv(torch.zeros(1, dtype=torch.float64), workers[0], "ps header")
            if header.item() == HEADER_DONE:
                break
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
    return {"server": index, "tensors": len(mine), "parameters": numel, "steps": steps, "applied": applied}

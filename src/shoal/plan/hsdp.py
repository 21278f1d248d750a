"""Whether a job of several GPU nodes should shard its ZeRO 2/3 state within each node and replicate it
across nodes (HSDP, parallel.dp_replicate = the nodes) or shard over every rank: the planner's predicted
step of the config's own layout both ways, on a preset GPU and its cluster's network (plan/network.py).
`shoal launch` asks before it writes a job file; `shoal plan` enumerates both among its layouts."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config import Config
from shoal.errors import UserError
from shoal.hardware import preset
from shoal.layout import resolve_layout
from shoal.plan.enumerate import with_keys
from shoal.plan.network import network as network_named
from shoal.plan.planner import Model, predict


@dataclass(frozen=True)
class Choice:
    replicate: int  # parallel.dp_replicate to run with (1: ZeRO over every rank)
    plain_s: float  # the predicted step, sharded over every dp rank
    hsdp_s: float  # and as HSDP, a replica a node
    profile: str  # what priced them ("h100 on nvlink4-ndr400")

    def line(self, nodes: int) -> str:
        faster, slower = (self.hsdp_s, self.plain_s) if self.replicate > 1 else (self.plain_s, self.hsdp_s)
        what = (f"HSDP (parallel.dp_replicate = {nodes}: ZeRO sharded within each node, replicated across the "
                f"{nodes})" if self.replicate > 1 else "ZeRO sharded over every rank (HSDP would be slower)")
        return (f"{what}: {faster * 1e3:.2f} ms a step predicted against {slower * 1e3:.2f} ms ({self.profile}; "
                f"`shoal plan --preset` to see every layout)")


def hsdp_choice(cfg: Config, nodes: int, nproc: int, gpu: str = "h100", net: str | None = None) -> Choice | None:
    """The faster of ZeRO over all `nodes` x `nproc` ranks and HSDP with a replica a node, for this config's
    layout; None where the choice does not arise (ZeRO 0/1, one node, a dp_replicate already set, replicas of
    local SGD / DiLoCo, a dp that the nodes do not split into shard groups of 2 or more)."""
    if cfg.precision.dtype == "auto":  # as the GPU nodes will choose it (every preset's GPU has bf16 tensor cores)
        cfg = with_keys(cfg, {"precision.dtype": "bf16"})
    p = cfg.parallel
    if nodes < 2 or p.zero < 2 or p.dp_replicate != 1 or cfg.sync.mode != "every-step":
        return None
    world = nodes * nproc
    plain = resolve_layout(cfg, world, cuda=True)
    if plain.dims.dp % nodes or plain.dims.dp // nodes < 2:
        return None
    hsdp_cfg = with_keys(cfg, {"parallel.dp_replicate": nodes})
    hsdp = resolve_layout(hsdp_cfg, world, cuda=True)
    profile = preset(gpu)
    name = network_named(net).name if net else profile.network
    if not name:
        raise UserError(f"--preset {gpu} has no cluster network to price HSDP with; give --network")
    profile = profile.model_copy(update={"network": name, "nproc": nproc, "nnodes": nodes})
    model = Model.build(cfg, cuda=True)
    plain_s = predict(model, cfg, plain, profile).step_time
    hsdp_s = predict(model, hsdp_cfg, hsdp, profile).step_time
    return Choice(nodes if hsdp_s < plain_s else 1, plain_s, hsdp_s, f"{gpu} on {name}")

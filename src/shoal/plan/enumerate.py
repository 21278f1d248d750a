"""Every layout `shoal plan` considers for a config and a number of processes: dp x tp x pp = world,
pipeline schedule, ZeRO stage 0-3 (on several nodes 2 and 3 also as HSDP with a replica per node, the
layout people reach for first: dp_replicate = the nodes, where that leaves 2 or more ranks a shard group),
for a mixture of experts expert parallelism (parallel.ep: the divisors of dp that divide its experts), for a model
whose sequences it can split context parallelism (parallel.cp: the divisors of dp whose chunks divide seq_len),
activation checkpointing on or off, micro-batch size (the divisors of the per-rank batch). Each is a copy
of the config with those keys set, checked by the same layout resolution (layout.py) and model checks
(preflight.py, parallel/fit.py) that a run's start applies: the reason a layout is invalid is the run's
own one-line error."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config import Config, validate_config
from shoal.errors import UserError
from shoal.layout import Layout, resolve_layout
from shoal.preflight import check_fit

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


@dataclass
class Candidate:
    keys: dict[str, object]  # the config keys this layout sets ("parallel.zero": 2, ...)
    cfg: Config | None = None
    layout: Layout | None = None
    reason: str | None = None  # why it is invalid (None: valid)

    def label(self) -> str:
        k = self.keys
        parts = [f"dp{k['parallel.dp']} tp{k['parallel.tp']} pp{k['parallel.pp']}"]
        if k.get("parallel.ep", 1) > 1:
            parts.append(f"ep{k['parallel.ep']}")
        if k.get("parallel.cp", 1) > 1:
            parts.append(f"cp{k['parallel.cp']}")
        if k["parallel.pp"] > 1:
            parts.append(str(k["parallel.pp_schedule"]))
        parts.append(f"zero{k['parallel.zero']}")
        if k.get("parallel.dp_replicate", 1) > 1:
            parts.append(f"hsdp{k['parallel.dp_replicate']}")
        if k["precision.activation_checkpointing"]:
            parts.append("ckpt")
        parts.append(f"mb{k['train.micro_batch_size']}")
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_keys(cfg: Config, keys: dict[str, object]) -> Config:
    """`cfg` with the dotted keys set, validated as a config file would be."""
    raw = cfg.model_dump(by_alias=True, exclude_none=True)
    for key, value in keys.items():
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = value
    return validate_config(raw, "plan")


def candidates(cfg: Config, world: int, bundle, source, cuda: bool, micro_batches: list[int] | None = None,
               nodes: int = 1):
    """Every layout for `world` processes on `nodes` nodes, valid or with its reason."""
    out, fits = [], {}  # check_model_fits' answers, per the keys they depend on
    gb = cfg.train.global_batch_size
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for schedule in (SCHEDULES if pp > 1 else (cfg.parallel.pp_schedule,)):
                hsdp = nodes > 1 and dp % nodes == 0 and dp // nodes > 1 and cfg.sync.mode == "every-step"
                for zero, replicate in [(z, 1) for z in range(4)] + ([(2, nodes), (3, nodes)] if hsdp else []):
                    for ep, cp in [(e, 1) for e in expert_splits(cfg, dp, zero)] + [
                            (1, c) for c in context_splits(cfg, bundle, dp)]:
                        batch_ranks = dp // cp
                        micros = micro_batches or (_divisors(gb // batch_ranks) if gb % batch_ranks == 0
                                                   else [cfg.train.micro_batch_size])
                        for ckpt in (False, True):
                            for micro in micros:
                                keys = {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp,
                                        "parallel.pp_schedule": schedule, "parallel.zero": zero,
                                        "parallel.dp_replicate": replicate,
                                        "precision.activation_checkpointing": ckpt, "train.micro_batch_size": micro,
                                        "parallel.pp_microbatches": 0}
                                if getattr(cfg.model, "experts", None) is not None:  # (--apply writes it)
                                    keys["parallel.ep"] = ep
                                if bundle.takes_positions:
                                    keys["parallel.cp"] = cp
                                out.append(check(cfg, keys, world, bundle, source, cuda, fits))
    return out


def context_splits(cfg: Config, bundle, dp: int) -> list[int]:
    """parallel.cp's values above 1 to plan: for a model whose sequences cp can split, each divisor of dp whose
    head-tail chunks divide model.seq_len, with every-step syncs (where cp is built)."""
    seq_len = getattr(cfg.model, "seq_len", None)
    if not bundle.takes_positions or not seq_len or cfg.sync.mode != "every-step":
        return []
    return [c for c in _divisors(dp) if c > 1 and seq_len % (2 * c) == 0]


def expert_splits(cfg: Config, dp: int, zero: int) -> list[int]:
    """parallel.ep's values to plan: 1, and for a mixture of experts each divisor of dp above 1 that divides its
    experts, where ep is built (ZeRO 0, 2 or 3, and under HSDP, where the experts are sharded over their edp ranks
    and counted as the rest is, over a replica's: an upper bound); the rest would be refused as a run refuses
    them."""
    experts = getattr(cfg.model, "experts", None)
    if experts is None or zero == 1:
        return [1]
    return [1] + [e for e in _divisors(dp) if e > 1 and experts % e == 0]


def check(cfg: Config, keys: dict, world: int, bundle, source, cuda: bool, fits: dict | None = None) -> Candidate:
    c = Candidate(keys)
    try:
        c.cfg = with_keys(cfg, keys)
        c.layout = resolve_layout(c.cfg, world, cuda)
        check_fit(c.cfg, c.layout, bundle, source, fits)
    except UserError as e:
        c.reason = str(e).removeprefix("plan: ")
    return c

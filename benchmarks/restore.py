"""What does a live regroup's in-memory restore cost? Every survivor puts its snapshot back into the new
generation's model and optimizer before it can step again, so this time is part of each failure's stall.

The default GPT (configs/gpt-tiny.toml) with its AdamW after one step, restored into a freshly built copy
(as a regroup does) by:
  - DCP's general loader: set_model_state_dict + set_optimizer_state_dict (flat optimizer state), which
    reshards between any layouts;
  - shoal's plain copy for a replicated layout (checkpoint/tensors.py copy_tensor_state), which
    apply_tensor_state now tries first.
Alternated, one thread, on an otherwise quiet machine.

    python -m benchmarks.restore [--repeats 30]

Last line:
    RESULT dcp_ms=<median> copy_ms=<median> ratio=<dcp/copy>
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from shoal.checkpoint.tensors import FLAT_OPTIM, copy_tensor_state, tensor_state
from shoal.config import load_config
from shoal.models.spec import DataSpec
from shoal.training.build import build_on
from shoal.training.optim import optimizer_groups

CONFIG = Path(__file__).resolve().parents[1] / "configs/gpt-tiny.toml"


def built(cfg):
    """A model and optimizer as a new generation builds them: weights left to be filled, no state yet."""
    model = build_on(cfg.model, DataSpec(kind="tokens", vocab_size=256), init=False).model
    cls, groups, hyper = optimizer_groups(model.parameters(), cfg.train)
    return model, cls(groups, **hyper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(CONFIG)
    model, optimizer = built(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = tensor_state(model, optimizer)
    n = sum(p.numel() for p in model.parameters())
    dcp, copy = [], []
    for _ in range(args.repeats):
        m, o = built(cfg)
        t0 = time.perf_counter()
        set_model_state_dict(m, state["model"])
        set_optimizer_state_dict(m, o, state["optim"], options=FLAT_OPTIM)
        dcp.append(time.perf_counter() - t0)
        m, o = built(cfg)
        t0 = time.perf_counter()
        if not copy_tensor_state(m, o, state):
            raise SystemExit("copy_tensor_state refused gpt-tiny's own state")
        copy.append(time.perf_counter() - t0)
    d, c = statistics.median(dcp) * 1e3, statistics.median(copy) * 1e3
    print(f"gpt-tiny, {n:,} parameters, AdamW, {args.repeats} restores each (median):")
    print(f"  DCP set_model/optimizer_state_dict  {d:6.2f} ms")
    print(f"  plain copy (copy_tensor_state)      {c:6.2f} ms")
    print(f"RESULT dcp_ms={d:.2f} copy_ms={c:.2f} ratio={d / c:.1f}")


if __name__ == "__main__":
    main()

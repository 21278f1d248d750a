"""The default job (`make run`) against a plain single-process torch loop given the same wall time.

shoal: `shoal train configs/gpt-tiny.toml --nproc 2`, exactly what `make run` trains (2 processes x 1
thread). The peer: one process with 2 threads (the same 2 cores), the same GPT class and config, the
same data split (shoal's TokenWindows over the same bytes: the validation windows are never trained
on), AdamW with the same hyperparameters, warmup and cosine schedule, random training windows, the
same global batch; it trains for as long as shoal's run took in all (start-up included: the peer's
budget is at least shoal's training time), sizing its schedule from the time of its first 20 steps.
Both models are then evaluated by the same function on the same validation windows (the ones shoal
validates on: train.val_batches x global batch). Medians over --repeats.

    .venv/bin/python -m benchmarks.default_job [--repeats 3] [--steps N]

Target (the default job's): validation loss <= 1.90 nats/byte in ~2 minutes of training. Last line:
    RESULT default_val_loss=<shoal's> plain_torch_val_loss=<the peer's> seconds=<shoal's run time>
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model

from shoal.config import load_config
from shoal.data.sources import build_source
from shoal.models.gpt import GPT

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/gpt-tiny.toml"


def shoal_run(tmp: Path, steps: int | None) -> tuple[Path, float]:
    run_dir = tmp / f"shoal-{len(list(tmp.iterdir()))}"
    fewer = ["--set", f"train.steps={steps}"] if steps else []
    subprocess.run([sys.executable, "-m", "shoal", "train", str(CONFIG), "--nproc", "2", "--run-dir", str(run_dir),
                    "--set", "metrics.progress=false", "--set", "metrics.tensorboard=false", *fewer],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir / "model.safetensors", json.loads((run_dir / "summary.json").read_text())["total_time_s"]


def build(cfg) -> GPT:
    return GPT(cfg.model, 256)  # cfg.model is the GPT's config (bytes: a vocabulary of 256)


@torch.no_grad()
def val_loss(model: GPT, source, cfg) -> float:
    """Mean loss per byte over the windows shoal validates on."""
    model.eval()
    n = min(cfg.train.val_batches * cfg.train.global_batch_size, source.num_val)
    total, count = 0.0, 0
    for idx in torch.arange(n).split(cfg.train.global_batch_size):
        b = source.val_batch(idx)
        logits = model(b["input"])
        total += F.cross_entropy(logits.flatten(0, 1), b["target"].flatten(), reduction="sum").item()
        count += b["target"].numel()
    return total / count


def plain_run(cfg, source, seconds: float) -> float:
    """The peer: train for `seconds` of wall time; returns its validation loss."""
    torch.set_num_threads(2)
    torch.manual_seed(cfg.train.seed)
    model = build(cfg)
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2))
    g = torch.Generator().manual_seed(t.seed)
    steps, step, start = None, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if step == 20:  # size the schedule to the budget
            steps = max(int(seconds / ((time.perf_counter() - start) / 20)), 21)
        total = steps or 10**9
        if step < t.warmup_steps:
            lr = t.lr * (step + 1) / t.warmup_steps
        else:
            progress = min((step - t.warmup_steps) / max(total - t.warmup_steps - 1, 1), 1.0)
            lr = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        b = source.train_batch(torch.randint(source.num_train, (t.global_batch_size,), generator=g))
        model.train()
        logits = model(b["input"])
        loss = F.cross_entropy(logits.flatten(0, 1), b["target"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
    print(f"plain torch: {step} steps in {time.perf_counter() - start:.1f} s", flush=True)
    return val_loss(model, source, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, help="train.steps of shoal's run (default: the config's; fewer for a try)")
    args = ap.parse_args()
    cfg = load_config(CONFIG)
    source = build_source(cfg.data, cfg.model.seq_len)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            weights, seconds = shoal_run(Path(d), args.steps)
            model = build(cfg)
            load_model(model, str(weights))  # strict; knows the head is tied to the embedding
            ours = val_loss(model, source, cfg)
            theirs = plain_run(cfg, source, seconds)
            rows.append((ours, theirs, seconds))
            print(f"shoal (2 processes): val loss {ours:.4f} in {seconds:.1f} s; plain torch (1 process, 2 threads, "
                  f"same time): {theirs:.4f}", flush=True)
    ours, theirs, seconds = (statistics.median(x) for x in zip(*rows, strict=True))
    print(f"RESULT default_val_loss={ours:.4f} plain_torch_val_loss={theirs:.4f} seconds={seconds:.1f}")


if __name__ == "__main__":
    main()

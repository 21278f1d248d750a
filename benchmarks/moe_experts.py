"""Expert parallelism against replicated experts, at the same model: a mixture of experts (benchmarks/configs/
moe_experts.toml: 4 layers of d_model 256, each with 8 experts of hidden 512, top 2: 13.8M parameters, 12.6M of
them experts) on 2 CPU workers of one thread each, its experts replicated on both (parallel.ep = 1: DDP all-reduces
every gradient) or split over them (parallel.ep = 2: each worker holds 4 experts, tokens go to their experts'
worker by all-to-all), alternated in rounds so machine noise hits both alike. Per run: the model state a worker
holds (parameters, gradients, optimizer: summary.json's memory_per_rank, the larger worker's), its peak RSS, the
median step time after the first 5 steps, and the bytes a worker sends a step: the gradients DDP all-reduces
(comm_bytes) plus, under ep, the tokens' all-to-all as if the choices spread evenly (half of a worker's choices
have their expert on the other worker: the worker sends those rows, and the other's results for the rows it
received, d_model floats each, in the forward and again in the backward).

    python -m benchmarks.moe_experts [--rounds 3] [--steps 30]

Last line:
    RESULT state_ratio=<ep 2 / ep 1 model state per worker> peak_ratio=<peak RSS> step_ratio=<step time>
           bytes_ratio=<bytes sent a step>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, Bench, read_jsonl, run, write_config

WARMUP = 5


def train(bench: Bench, ep: int, steps: int) -> dict:
    run_dir = bench.out / f"ep{ep}-{bench.count}"
    config = write_config("moe_experts", bench.out / f"ep{ep}.toml",
                          {"parallel": {"ep": ep}, "train": {"steps": steps}, "metrics": {"log_interval": 1}})
    run([sys.executable, "-m", "shoal", "train", str(config), "--nproc", "2", "--run-dir", str(run_dir)],
        cwd=ROOT, env=bench.env, timeout=600, log=bench.log(f"ep{ep}"))
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    state = max(r["params"] + r["grads"] + r["optimizer"] for r in summary["memory_per_rank"])
    tokens = 16 * 128  # the global batch's tokens
    moe_layers, d_model, choices = 4, 256, 2
    # under ep 2: a worker's tokens' choices, half of them to the other worker; those rows out and the other's
    # results back, forward and backward, fp32
    a2a = 0 if ep == 1 else moe_layers * (tokens // 2) * choices // 2 * d_model * 4 * 2 * 2
    late = [m for m in metrics if m["step"] > WARMUP]
    return {"state": state, "peak": summary["peak_memory_bytes"], "parameters": summary["parameters"],
            "step": statistics.median(m["step_time_s"] for m in late),
            "bytes": statistics.median(m["comm_bytes"] for m in late) + a2a}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as d:
        bench = Bench(Path(d), Path(d), cuda=False)
        for r in range(a.rounds):
            for ep in (1, 2) if r % 2 == 0 else (2, 1):
                runs[ep].append(train(bench, ep, a.steps))
                got = runs[ep][-1]
                print(f"round {r + 1} ep {ep}: state {got['state'] / 2**20:.1f} MiB, peak {got['peak'] / 2**20:.0f} "
                      f"MiB, step {got['step'] * 1e3:.0f} ms, sent {got['bytes'] / 2**20:.2f} MiB a step", flush=True)

    def ratio(key: str) -> float:
        return statistics.median(x[key] for x in runs[2]) / statistics.median(x[key] for x in runs[1])

    print(f"RESULT state_ratio={ratio('state'):.3f} peak_ratio={ratio('peak'):.3f} step_ratio={ratio('step'):.3f} "
          f"bytes_ratio={ratio('bytes'):.3f}")


if __name__ == "__main__":
    main()

"""Memory falls with context parallelism: shoal's GPT (benchmarks/configs/context_memory.toml: 8 layers of d_model
128 on sequences of 16,384 bytes) on 2 CPU workers of one thread each, each sequence whole on one worker
(parallel.cp = 1, dp 2: a worker trains one sequence a step) or split over both (parallel.cp = 2: each worker holds
the head-tail half of both sequences, one after the other), the same global batch of 2 sequences and the same
model, alternated in rounds. Per run: the peak RSS of the larger worker (summary.json's peak_memory_bytes: the
process's high-water mark, the interpreter and torch included), the model state it holds, and the median step time.

    python -m benchmarks.context_memory [--rounds 2] [--steps 2] [--seq-len 16384]

Last line:
    RESULT peak_ratio=<cp 2 / cp 1 peak per worker> step_ratio=<step time> cp1_peak_mib=<> cp2_peak_mib=<>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, Bench, read_jsonl, run, write_config


def train(bench: Bench, cp: int, steps: int, seq_len: int, n_layer: int) -> dict:
    run_dir = bench.out / f"cp{cp}-{bench.count}"
    config = write_config("context_memory", bench.out / f"cp{cp}.toml",
                          {"parallel": {"cp": cp}, "train": {"steps": steps},
                           "model": {"seq_len": seq_len, "n_layer": n_layer}})
    run([sys.executable, "-m", "shoal", "train", str(config), "--nproc", "2", "--run-dir", str(run_dir)],
        cwd=ROOT, env=bench.env, timeout=1800, log=bench.log(f"cp{cp}"))
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return {"peak": summary["peak_memory_bytes"],
            "state": max(r["params"] + r["grads"] + r["optimizer"] for r in summary["memory_per_rank"]),
            "step": statistics.median(m["step_time_s"] for m in metrics if "step_time_s" in m)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--n-layer", type=int, default=8)
    a = ap.parse_args()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as d:
        bench = Bench(Path(d), Path(d), cuda=False)
        for r in range(a.rounds):
            for cp in (1, 2) if r % 2 == 0 else (2, 1):
                runs[cp].append(train(bench, cp, a.steps, a.seq_len, a.n_layer))
                got = runs[cp][-1]
                print(f"round {r + 1} cp {cp}: peak {got['peak'] / 2**20:.0f} MiB, state {got['state'] / 2**20:.1f} "
                      f"MiB, step {got['step']:.2f} s", flush=True)

    def median(cp: int, key: str) -> float:
        return statistics.median(x[key] for x in runs[cp])

    print(f"RESULT peak_ratio={median(2, 'peak') / median(1, 'peak'):.3f} "
          f"step_ratio={median(2, 'step') / median(1, 'step'):.3f} cp1_peak_mib={median(1, 'peak') / 2**20:.0f} "
          f"cp2_peak_mib={median(2, 'peak') / 2**20:.0f}")


if __name__ == "__main__":
    main()

"""benchmarks/gpu_step.py's figures: a run's row (step time, tokens/s, MFU against the data sheet and the measured
matmul, host syncs, peak memory), the table, the ratios against the targets,
the fp8 section's lines, gpu_step.json and the RESULT line. Standard library only."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

TARGET_RATIO = 1.00  # shoal / plain loop, eager and compiled: at least as fast as the loop a user writes
TARGET_MFU = 0.41  # llm.c's GPT-2 124M on H100s (../docs/gpus.md's anchors)


def tail(text: str, limit: int = 300) -> str:
    """The last lines that say something (an error's own line, not the traceback's frames)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    said = " | ".join(lines[-3:]) if lines else "(no output)"
    return said if len(said) <= limit else "..." + said[-limit + 3:]


def matmul_params(shape: dict) -> int:
    """N of 6N: every parameter of shoal's GPT but the position table; the tied embedding (the head) once.
    A block: q, k, v, proj (d x d + d each), up and down (4 d^2 + 4 d, 4 d^2 + d), two LayerNorms (2 d each)."""
    L, d, V = shape["n_layer"], shape["d_model"], shape["vocab_size"]
    return L * (12 * d * d + 13 * d) + V * d + 2 * d


def flops_per_token(shape: dict) -> int:
    return 6 * matmul_params(shape) + 12 * shape["n_layer"] * shape["seq_len"] * shape["d_model"]


def row(who: str, mode: str, mb: int, got: dict, b) -> dict:
    f, shape = b.facts, b.shape
    tokens_s = mb * shape["seq_len"] / got["step_s"]
    achieved = tokens_s * flops_per_token(shape)
    r = {"who": who, "mode": mode, "mb": mb, "status": "ok", "step_s": got["step_s"], "tokens_s": tokens_s,
         "flops_s": achieved, "mfu_sheet": achieved / f["sheet_flops"] if f.get("sheet_flops") else None,
         "mfu_matmul": achieved / f["matmul_flops"], "peak_bytes": got.get("peak_bytes"),
         "syncs": got["syncs"]["per_step"] if "syncs" in got else None, "own_median_s": got.get("own_median_s"),
         "losses": got.get("losses")}
    if "syncs" in got:
        r["sync_detail"] = got["syncs"]
    if got.get("matmul_params") not in (None, matmul_params(shape)):
        r["note"] = f"the model built has {got['matmul_params']} matmul weights, the formula {matmul_params(shape)}"
    return r


def oom_row(who: str, mode: str, mb: int, why: str) -> dict:
    return {"who": who, "mode": mode, "mb": mb, "status": "OOM", "note": why}


def failed_row(who: str, mode: str, mb: int, why: str) -> dict:
    return {"who": who, "mode": mode, "mb": mb, "status": "FAIL", "note": why}


def size(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def show(r: dict) -> None:
    if r["status"] != "ok":
        print(f"{r['who']:<12} {r['mode']:<9} {r['mb']:>4}  {r['status']}: {r['note']}", flush=True)
        return
    own = f"  (shoal's own median {r['own_median_s'] * 1e3:.1f} ms)" if r.get("own_median_s") else ""
    c = r.get("clocks")
    own += f"  [SM {c['sm_mhz_median']:.0f} MHz, {c['temp_c_max']:.0f} C, {c['power_w_mean']:.0f} W]" if c else ""
    syncs = "-" if r["syncs"] is None else f"{r['syncs']:.1f}"
    print(f"{r['who']:<12} {r['mode']:<9} {r['mb']:>4} {r['step_s'] * 1e3:>9.1f} {r['tokens_s']:>11,.0f} "
          f"{pct(r['mfu_sheet']):>9} {pct(r['mfu_matmul']):>10} {syncs:>10} {size(r['peak_bytes']):>10}{own}",
          flush=True)


def header(b) -> None:
    f, s = b.facts, b.shape
    if f["cuda"]:
        card = (f"{f['name']} (compute capability {'.'.join(map(str, f['capability']))}, {size(f['memory_bytes'])}, "
                f"driver {f['driver']}), torch {f['torch']} (CUDA {f['cuda_version']})")
    else:
        card = f"CPU, torch {f['torch']}"
    print(f"gpu_step: {card}; run dirs and logs in {b.out}")
    if not f["cuda"]:
        print("no CUDA GPU: ran on CPU with a tiny model; the figures are not GPU figures (compiled: dynamo and "
              "AOTAutograd only, no inductor)")
    elif b.args.quick:
        print("--quick: a tiny model and a few steps; the figures are a smoke test, not the benchmark's")
    n = matmul_params(s)
    print(f"GPT {s['n_layer']} x {s['d_model']}, {s['n_head']} heads, {s['seq_len']} tokens, vocabulary "
          f"{s['vocab_size']} ({(n + s['seq_len'] * s['d_model']) / 1e6:.1f}M parameters, N = {n / 1e6:.1f}M without "
          f"the position table; 6N + 12LTd = {flops_per_token(s) / 1e6:.1f} MFLOP per token), bf16 autocast, one "
          f"process; {b.warmup} warm-up + {b.timed} timed steps per run, logged every {b.interval}")
    sheet = (f"data sheet {f['sheet_flops'] / 1e12:.1f} TFLOP/s ({f['sheet_name']})" if f.get("sheet_flops")
             else "no data sheet for this device")
    print(f"bf16 matmul {f['matmul_n']}^3: {f['matmul_flops'] / 1e12:.2f} TFLOP/s measured (best of 5); {sheet}")



def trace_summary(path: Path, steps: int) -> dict:
    """What a torch.profiler Chrome trace of `steps` steps shows, per step: its GPU kernels (on a CPU, its
    operators: the trace has no kernels), how long the device was busy (the union of the kernels' spans) and
    idle within the traced span, and each kernel's (operator's) time and count."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kind = "kernel" if any(e.get("cat") == "kernel" for e in events) else "cpu_op"
    ev = sorted((e for e in events if e.get("cat") == kind), key=lambda e: e["ts"])
    if not ev:
        raise ValueError(f"{path.name} holds no {kind} events")
    busy, end = 0.0, ev[0]["ts"]
    for e in ev:  # the union of the spans (operators nest; a GPU's streams overlap)
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            busy, end = busy + stop - start, stop
    span = max(e["ts"] + e["dur"] for e in ev) - ev[0]["ts"]
    per: dict[str, list[float]] = {}
    for e in ev:
        t = per.setdefault(e["name"], [0.0, 0])
        t[0] += e["dur"] / 1e3 / steps
        t[1] += 1 / steps
    return {"kind": kind, "per_step": len(ev) / steps, "busy_ms": busy / 1e3 / steps,
            "idle_ms": (span - busy) / 1e3 / steps, "ops": per, "file": str(path)}


def trace_lines(trace: dict) -> None:
    """The two traces side by side: per step, kernels, busy and idle time; the largest; those that differ."""
    if "error" in trace:
        print(f"trace: failed: {trace['error']}")
        return
    sides = {k: v for k, v in trace.items() if k in ("plain loop", "shoal train")}
    kind = next(iter(sides.values()))["kind"]
    print(f"trace of the compiled step, steps {trace['steps'][0]}-{trace['steps'][1]} at micro-batch {trace['mb']}, "
          f"per step ({'GPU kernels' if kind == 'kernel' else 'CPU operators: no GPU'}):")
    for who, t in sides.items():
        top = sorted(t["ops"].items(), key=lambda kv: -kv[1][0])[:5]
        print(f"  {who:<12} {t['per_step']:.0f} {kind}s, busy {t['busy_ms']:.2f} ms, idle {t['idle_ms']:.2f} ms; "
              "largest: " + "; ".join(f"{name[:40]} {ms:.2f} ms x{n:.0f}" for name, (ms, n) in top))
    if len(sides) == 2:
        a, b = sides["plain loop"]["ops"], sides["shoal train"]["ops"]
        diff = sorted(((b.get(k, [0, 0])[0] - a.get(k, [0, 0])[0], k) for k in {*a, *b}), key=lambda d: -abs(d[0]))
        print("  shoal - loop, the largest differences: " + "; ".join(
            f"{name[:40]} {ms:+.3f} ms ({b.get(name, [0, 0])[1]:.0f} vs {a.get(name, [0, 0])[1]:.0f})"
            for ms, name in diff[:6]))


def table_header() -> None:
    print(f"\n{'run':<12} {'mode':<9} {'mb':>4} {'step ms':>9} {'tokens/s':>11} {'MFU sheet':>9} {'MFU matmul':>10} "
          f"{'syncs/step':>10} {'peak':>10}", flush=True)


def loss_lines(loss: dict) -> None:
    """The loss each side computes, and what each of shoal's costs against the loop's."""
    print("loss: the plain loop's F.cross_entropy (mean) of the bf16 logits under autocast, which runs it in fp32; "
          "shoal's GPT: model.fused_loss = \"auto\", the loss alone under torch.compile in an eager run on CUDA (the "
          "plain fp32 loss on the CPU), inside the compiled model under train.compile")
    if "error" in loss:
        print(f"  head + loss alone: failed: {loss['error']}")
        return
    sh, loop = loss["shape"], loss["sides"]["loop F.cross_entropy"]
    print(f"  head + loss alone, forward and backward, {sh['tokens']} tokens x {sh['d_model']} -> {sh['vocab']} "
          f"({loss['device']}): median ms, peak above the inputs, loss's relative error against float64")
    for name, r in loss["sides"].items():
        print(f"    {name:<22} {r['ms']:8.2f} ms ({r['ms'] / loop['ms']:.2f}x the loop's)  "
              f"{size(r['peak_above_inputs_bytes']):>9}  {r['loss_rel_error']:.1e}")


def short(site: str) -> str:
    """A file:line inside shoal or torch, from the package on (site-packages/torch/x.py:3 -> torch/x.py:3)."""
    for package in ("/shoal/", "/torch/", "/benchmarks/"):
        if package in site:
            return package[1:] + site.rsplit(package, 1)[1]
    return site


def ratio_key(mode: str, mb: int) -> str:
    return f"{mode}_ratio_mb{mb}"


def ratios(rows: list[dict]) -> dict[str, dict | None]:
    """shoal / plain loop step time per (mode, micro-batch) that either side ran at: each pair's shoal run over its
    plain loop's, and of those the median, min and max (the tuned run: over the compiled plain loop's median);
    None where no pair has both sides (out of memory, failed)."""
    ok = [r for r in rows if r["status"] == "ok"]
    out: dict[str, dict | None] = {}
    for r in rows:
        key = ratio_key(r["mode"], r["mb"])
        ran = [x for x in ok if x["mb"] == r["mb"]]
        if key in out or (r["status"] == "OOM" and r["who"] == "plain loop" and not ran):
            continue  # a micro-batch that did not fit, tried again at half: its ratio is the half's
        if r["mode"] == "tuned":
            plain = [x["step_s"] for x in ran if x["who"] == "plain loop" and x["mode"] == "compiled"]
            each = [x["step_s"] / statistics.median(plain) for x in ran if x["mode"] == "tuned"] if plain else []
        else:
            pairs: dict[int, dict] = {}
            for x in ran:
                if x["mode"] == r["mode"]:
                    pairs.setdefault(x.get("pair", 0), {})[x["who"]] = x["step_s"]
            each = [p["shoal train"] / p["plain loop"] for p in pairs.values() if len(p) == 2]
        out[key] = ({"median": statistics.median(each), "min": min(each), "max": max(each), "pairs": len(each)}
                    if each else None)
    return out


def clock_line(rows: list[dict]) -> str | None:
    """The range of the clocks the runs ran at (nvidia-smi's samples), per side."""
    said = []
    for who in ("plain loop", "shoal train"):
        c = [r["clocks"] for r in rows if r.get("clocks") and r["who"] == who]
        if c:
            low, high = min(x["sm_mhz_min"] for x in c), max(x["sm_mhz_median"] for x in c)
            hot, power = max(x["temp_c_max"] for x in c), [x["power_w_mean"] for x in c]
            said.append(f"{who}: SM clock {low:.0f}-{high:.0f} MHz (lowest sample - highest run median), up to "
                        f"{hot:.0f} C, {min(power):.0f}-{max(power):.0f} W mean")
    return "; ".join(said) or None


def best_mfu(rows: list[dict], who: str) -> tuple[float | None, str]:
    ok = [r for r in rows if r["status"] == "ok" and r["who"] == who]
    key = "mfu_sheet" if ok and ok[0]["mfu_sheet"] is not None else "mfu_matmul"
    if not ok:
        return None, "-"
    r = max(ok, key=lambda r: r[key])
    return r[key], f"{r['mode']} mb{r['mb']}, against the {'data sheet' if key == 'mfu_sheet' else 'measured matmul'}"


def fp8_lines(fp8: dict) -> list[str]:
    if fp8["status"] != "run":
        return [f"fp8: {fp8['status']}: {fp8['why']}"]
    s, runs = fp8["shape"], fp8["runs"]
    params = (matmul_params(s) + s["seq_len"] * s["d_model"]) / 1e9
    lines = [f"fp8: shoal train of a GPT {s['n_layer']} x {s['d_model']} ({params:.2f}B parameters), micro-batch "
             f"{fp8['micro']}, compiled, {fp8['steps']} steps, bf16 against precision.dtype = fp8:"]
    for dtype, r in runs.items():
        if "step_s" in r:
            lines.append(f"  {dtype:<5} {r['step_s'] * 1e3:.1f} ms/step, peak {size(r['peak_bytes'])}, loss "
                         + " ".join(f"{r['losses'][k]:.3f}" for k in sorted(r["losses"])))
        else:
            lines.append(f"  {dtype:<5} {r.get('oom') or r.get('error')}")
    if all("step_s" in r for r in runs.values()):
        a, b = runs["bf16"], runs["fp8"]
        common = sorted(set(a["losses"]) & set(b["losses"]))
        diff = max(abs(a["losses"][k] - b["losses"][k]) / abs(a["losses"][k]) for k in common)
        lines.append(f"  fp8 / bf16 step time {b['step_s'] / a['step_s']:.3f}; losses at steps {common[0]}-"
                     f"{common[-1]}: largest relative difference {diff:.2e}")
        fp8["speedup"], fp8["loss_diff"] = a["step_s"] / b["step_s"], diff
    return lines


def summary(b, rows: list[dict], syncs: dict, fp8: dict, seconds: float, tuned: str) -> bool:
    """The ratios, MFU, syncs, the tuned runs' and fp8 lines and the RESULT line; True when a run failed."""
    f = b.facts
    r = ratios(rows)
    if r:
        said = ", ".join(f"{k.replace('_ratio_', ' ')} " + ("-" if v is None else f"{v['median']:.3f} [{v['min']:.3f}-"
                                                             f"{v['max']:.3f}, {v['pairs']} pairs]")
                         for k, v in r.items())
        met = all(v is not None and v["median"] <= TARGET_RATIO for k, v in r.items() if not k.startswith("tuned"))
        print(f"\nshoal / plain loop step time, median [min-max] of alternated pairs: {said} (target <= "
              f"{TARGET_RATIO:.2f}, eager and compiled: {'met' if met else 'not met'})")
    clocks = clock_line(rows)
    print(f"clocks: {clocks}" if clocks else "clocks: not sampled (no nvidia-smi)")
    mfu, where = best_mfu(rows, "shoal train")
    mfu_plain, where_plain = best_mfu(rows, "plain loop")
    if rows:
        print(f"best MFU: shoal {pct(mfu)} ({where}), plain loop {pct(mfu_plain)} ({where_plain}) (target >= "
              f"{TARGET_MFU:.0%}, llm.c's: {'met' if mfu and mfu >= TARGET_MFU else 'not met'})")
    plain_syncs = next((x for x in rows if x.get("syncs") is not None), None)
    if syncs or plain_syncs:
        print("host syncs per step: " + sync_line(plain_syncs, syncs, f["cuda"]))
    print(tuned)
    for line in fp8_lines(fp8):
        print(line)
    failed = [x for x in rows if x["status"] == "FAIL"] + ([1] if "error" in syncs else [])
    medians = {k: "-" if v is None else f"{v['median']:.3f}" for k, v in r.items()}
    card = f'"{f["name"]}"' if f["cuda"] else '"cpu"'
    fields = [f"card={card}", f"device={'cuda' if f['cuda'] else 'cpu'}", f"torch={f['torch']}",
              *(f"driver={f['driver']}" for _ in [1] if f["cuda"]),
              *(f"{k}={median}" for k, median in medians.items()),
              *(f"{k.replace('ratio', 'spread')}={v['min']:.3f}-{v['max']:.3f}" for k, v in r.items() if v),
              f"best_mfu={'-' if mfu is None else f'{mfu:.3f}'}",
              f"best_mfu_plain={'-' if mfu_plain is None else f'{mfu_plain:.3f}'}",
              f"matmul_tflops={f['matmul_flops'] / 1e12:.2f}",
              *(f"loss_fused_vs_loop={v['shoal fused']['ms'] / v['loop F.cross_entropy']['ms']:.3f}"
                for v in [f.get("loss", {}).get("sides")] if v),
              f"syncs_shoal={syncs['per_step']:.1f}" if "per_step" in syncs else "syncs_shoal=-",
              f"syncs_plain={plain_syncs['syncs']:.1f}" if plain_syncs else "syncs_plain=-",
              f"fp8={fp8['status'].replace(' ', '-')}",
              *(f"fp8_speedup={fp8['speedup']:.3f}" for _ in [1] if "speedup" in fp8),
              f"failed={len(failed)}", f"seconds={seconds:.0f}"]
    print("RESULT " + " ".join(fields))
    return bool(failed)


def sync_line(plain: dict | None, syncs: dict, cuda: bool) -> str:
    said = [] if cuda else ["on the CPU, the reads of one value a GPU would wait for"]
    if plain:
        d = plain["sync_detail"]
        sites = "; ".join(f"{k} {v}" for k, v in d["sites"].items())
        said.append(f"plain loop {plain['syncs']:.1f} ({plain['mode']} mb{plain['mb']}, {d['steps']} steps: {sites})")
    if "per_step" in syncs:
        sites = "; ".join(f"{k} {v:.1f}" for k, v in syncs["sites"].items())
        said.append(f"shoal {syncs['per_step']:.1f} (median of {syncs['steps']} steps; per step: {sites})")
    elif syncs:
        said.append(f"shoal: not measured ({syncs.get('error')})")
    return "; ".join(said)


def save(b, rows: list[dict], syncs: dict, fp8: dict | None = None) -> None:
    """gpu_step.json in the run's folder, and in $OUT where the device tool brings files back (as the runs go)."""
    data = {"facts": b.facts, "shape": b.shape, "warmup": b.warmup, "timed": b.timed, "rows": rows,
            "syncs": syncs, "fp8": fp8}
    text = json.dumps(data, indent=1, default=str)
    (b.out / "gpu_step.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_step.json").write_text(text)

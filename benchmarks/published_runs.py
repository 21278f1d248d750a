"""How close is `shoal plan` to large training runs that were published? Paper math: no GPU runs here.

Each row is a run whose authors published the model's shape, the GPUs, the layout (tp, pp, dp, virtual
stages, micro-batch, global batch), the precision, the activation recomputation and the throughput per
GPU. For each, the planner plans the row's own model on the row's own cluster (the data-sheet preset and
its network, `--memory` the GPU's) exactly as `shoal plan --preset` does; the script takes the planner's
prediction for the row's own layout and that layout's rank among every valid layout the planner
considered. Rows, their sources (paper, page, table) and what of them the planner cannot express are in
ROWS below.

Throughput per GPU is converted to an iteration time with the source's own FLOP formula
(Narayanan et al. 2021, eq. 3: F = 96 B s l h^2 (1 + s/6h + V/16lh), which counts the recomputed
forward; BLOOM's logbook counts FLOPs the same way, "the 4*2 co-efficient"); rows that report an
iteration time are compared on it directly. The error on throughput per GPU is then
reported time / predicted time - 1 (the formula cancels).

Achievable compute. A preset holds the vendor's dense peak (A100: 312 TFLOP/s), which no training run
reaches; the planner prices each traced operator by kind and size from it (a product's tile waves and
inner dimension at one measured matmul efficiency, the memory-bound ones at 85% of the data sheet's
bandwidth: plan/kernels.py), and what a real run's kernels reach beyond that is one more factor. No published
end-to-end measurement of that fraction was found for these stacks, so it is CALIBRATED, as one global
factor (HardwareProfile.compute_efficiency: every compute second divided by it), and scored
LEAVE-ONE-OUT: each row is predicted with the median of the factors the other rows imply, never its own.
The factor each row implies, f = (compute + bubble at peak) / (reported time - communication), is
printed too.

    python -m benchmarks.published_runs [--rows NAME,NAME,...]

Last line:
    RESULT published_median_err=<x> published_worst_err=<y> published_rank_median=<z> top5=<k>/<n>
           efficiency=<median factor>
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

NARAYANAN = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
SC21 = "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (the paper's own Table 1 settings)"
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
               "(arXiv 2205.05198)")
CALCULON = "calculon-ai/calculon calculon/megatron/validation.py and validation/*_full.json"
BLOOM = "BigScience tr11-176B-ml logbook, bigscience-workshop/bigscience train/tr11-176B-ml/README.md"


@dataclass
class Row:
    name: str
    source: str  # citation: paper or logbook, page, table
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    tp: int
    pp: int
    micro: int
    batch: int  # global batch, sequences
    reported: float  # TFLOP/s per GPU (unit "tflops") or seconds per iteration ("s")
    unit: str = "tflops"
    v: int = 1  # virtual pipeline stages per rank (interleaved 1F1B when > 1)
    zero: int = 0
    recompute: str = "full"  # full: every block recomputed in backward (the planner's activation checkpointing)
    precision: str = "fp16"
    preset: str = "a100"
    network: str = "nvlink3-hdr200"
    memory: float = 80 * 2 ** 30  # bytes of one GPU: an "80 GB" A100 has 80 GiB
    # attention as the run computed it: none of these runs had fused (flash) attention (FlashAttention is
    # Dao et al., May 2022; Megatron-LM took it up in 2023), so the planner traces it materialised, with
    # Megatron-LM's default --attention-dropout 0.1 (megatron/arguments.py); and its default
    # --hidden-dropout 0.1 after the embeddings, attention and the MLP, whose masks the runs kept for
    # backward (Korthikanti et al. 2022, section 4.1), where shoal's GPT under tensor parallelism has none
    fused_attention: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    notes: list[str] = field(default_factory=list)  # what the planner cannot express, and how it is taken

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def flops(self) -> float:
        """FLOPs of one iteration by the source's formula (Narayanan et al. 2021, eq. 3; recompute counted)."""
        b, s, n, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))

    def reported_time(self) -> float:
        return self.reported if self.unit == "s" else self.flops() / (self.reported * 1e12 * self.gpus)

    def reported_tflops(self) -> float:
        return self.flops() / (self.reported_time() * self.gpus) / 1e12


def _t1(name, layers, hidden, heads, gpus, tp, pp, micro, batch, tflops, v=1):
    # Narayanan et al. 2021, p. 8, Table 1 (V = 51,200, s = 2048, interleaved schedule with the scatter/gather
    # optimisation, full recomputation, mixed precision; Selene: DGX A100 80 GB, 8 x 200 Gb/s HDR per node);
    # micro-batch and layers per virtual stage from the paper's own run_table_1.sh
    return Row(name, f"{NARAYANAN}, p. 8, Table 1; micro-batch and virtual stages: {SC21}", layers, hidden, heads,
               51200, 2048, gpus, tp, pp, micro, batch, tflops, v=v)


def _t2_ptd(name, layers, hidden, heads, gpus, pp, batch, tflops):
    # Narayanan et al. 2021, p. 9, Table 2, "PTD Parallelism": model-parallel size 96 (175B) = tp 8 x pp 12 and
    # 280 (530B) = tp 8 x pp 35, microbatch 1; the schedule is not stated there (taken as 1F1B)
    return Row(name, f"{NARAYANAN}, p. 9, Table 2 (PTD Parallelism)", layers, hidden, heads, 51200, 2048, gpus, 8,
               pp, 1, batch, tflops, notes=["Table 2 does not state the schedule: 1F1B"])


def _t2_zero3(name, layers, hidden, heads, gpus, micro, batch, tflops):
    # Narayanan et al. 2021, p. 9, Table 2, "ZeRO-3 without Model Parallelism" (DeepSpeed's ZeRO-3, dp only)
    return Row(name, f"{NARAYANAN}, p. 9, Table 2 (ZeRO-3 without model parallelism)", layers, hidden, heads,
               51200, 2048, gpus, 1, 1, micro, batch, tflops, zero=3, precision="bf16",
               notes=["DeepSpeed ZeRO-3 priced as shoal's ZeRO 3 (FSDP2: a gather per block, prefetched)",
                      "fp16 with ZeRO 3 is refused by shoal (loss scaling of sharded gradients): bf16, the same "
                      "A100 peak"])


def _korthikanti(name, layers, hidden, heads, gpus, pp, batch, micro, seconds, v):
    # Korthikanti et al. 2022: full-recompute baseline (tensor parallel, no sequence parallelism) of its
    # 22B / 175B / 530B / 1T GPT-3-style models on Selene A100s. Iteration times and layouts as transcribed
    # by calculon (Isaev et al., SC'23), which validates against these runs; the paper's own table was not
    # reachable here, so its table number is not given. V = 51,200 as in Narayanan et al.
    return Row(name, f"{KORTHIKANTI}, full-recompute iteration times; transcribed in {CALCULON}", layers, hidden,
               heads, 51200, 2048, gpus, 8, pp, micro, batch, seconds, unit="s", v=v,
               notes=["vocabulary taken as 51,200 (Megatron's GPT-3 setting)"])


ROWS = [
    _t1("megatron-1.7B", 24, 2304, 24, 32, 1, 1, 16, 512, 137),
    _t1("megatron-3.6B", 30, 3072, 32, 64, 2, 1, 16, 512, 138),
    _t1("megatron-7.5B", 36, 4096, 32, 128, 4, 1, 16, 512, 142),
    _t1("megatron-18B", 40, 6144, 48, 256, 8, 1, 8, 1024, 135),
    _t1("megatron-39B", 48, 8192, 64, 512, 8, 2, 4, 1536, 138),
    _t1("megatron-76B", 60, 10240, 80, 1024, 8, 4, 2, 1792, 140, v=3),
    _t1("megatron-145B", 80, 12288, 96, 1536, 8, 8, 2, 2304, 148, v=2),
    _t1("megatron-310B", 96, 16384, 128, 1920, 8, 16, 1, 2160, 155, v=2),
    _t1("megatron-530B", 105, 20480, 128, 2520, 8, 35, 1, 2520, 163, v=3),
    _t1("megatron-1T", 128, 25600, 160, 3072, 8, 64, 1, 3072, 163),
    _t2_ptd("ptd-175B-384", 96, 12288, 96, 384, 12, 1536, 153),
    _t2_ptd("ptd-175B-768", 96, 12288, 96, 768, 12, 1536, 149),
    _t2_ptd("ptd-175B-1536", 96, 12288, 96, 1536, 12, 1536, 141),
    _t2_ptd("ptd-530B-560", 105, 20480, 128, 560, 35, 2240, 171),
    _t2_ptd("ptd-530B-1120", 105, 20480, 128, 1120, 35, 2240, 167),
    _t2_ptd("ptd-530B-2240", 105, 20480, 128, 2240, 35, 2240, 159),
    _t2_zero3("zero3-175B-384", 96, 12288, 96, 384, 4, 1536, 144),
    _t2_zero3("zero3-175B-768", 96, 12288, 96, 768, 2, 1536, 88),
    _t2_zero3("zero3-175B-1536", 96, 12288, 96, 1536, 1, 1536, 44),
    _t2_zero3("zero3-530B-640", 105, 20480, 128, 640, 4, 2560, 138),
    _t2_zero3("zero3-530B-1120", 105, 20480, 128, 1120, 2, 2240, 98),
    _t2_zero3("zero3-530B-2240", 105, 20480, 128, 2240, 1, 2240, 48),
    _korthikanti("korthikanti-22B", 48, 6144, 64, 8, 1, 4, 4, 1.42, 1),
    _korthikanti("korthikanti-175B", 96, 12288, 96, 64, 8, 64, 1, 18.13, 3),
    _korthikanti("korthikanti-530B", 105, 20480, 128, 280, 35, 280, 1, 49.05, 3),
    _korthikanti("korthikanti-1T", 128, 25600, 160, 512, 64, 512, 1, 94.42, 1),
    # BLOOM 176B: 70 layers, hidden 14336, 112 heads, vocabulary 250,880 (padded), s = 2048; 384 A100 80 GB
    # (48 nodes of 8, NVLink, 4 x 100 Gb/s Omni-Path per node); TP 4, PP 12, DP 8, MBS 2, GBS 2048; bf16; ZeRO
    # stage 1 (DeepSpeed's BF16_Optimizer); DeepSpeed activation checkpointing. Logbook "Important
    # checkpoints": iteration 85376, 104.70 s per iteration at global batch 2048, "TFLOPs: 149.77".
    Row("bloom-176B", f"{BLOOM}, sections Architecture, Replica setup, Important checkpoints", 70, 14336, 112,
        250880, 2048, 384, 4, 12, 2, 2048, 104.70, unit="s", zero=1, precision="bf16", network="nvlink3-opa400",
        notes=["ALiBi and the embedding LayerNorm are not in shoal's GPT (learned positions): a few "
               "elementwise operators", "the pipeline split counts the embeddings as a block (their "
               "--pp-partition-method); shoal balances by FLOPs"]),
]


# A token stream for every row: the runs' data is not at hand and not needed (the planner reads a data
# source only for its sizes), but the default source (the stdlib's text, ~8 MB) holds fewer validation
# windows of 2,049 tokens than dp has ranks at 1,536 GPUs, which a run's start refuses. 12M tokens (a 24 MB
# sparse file), 40% held out: 2,342 validation and 3,513 training windows, more than any row's dp and
# global batch; its largest token makes the vocabulary 51,200, as the rows' model.vocab_size sets it.
TOKENS = 12_000_000
VAL_FRACTION = 0.4


def token_file() -> Path:
    import numpy as np

    path = Path(tempfile.gettempdir()) / "shoal-published-runs" / f"tokens-{TOKENS}.bin"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tokens = np.zeros(TOKENS, dtype=np.uint16)
        tokens[-1] = 51199
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tokens.tofile(tmp)
        tmp.replace(path)
    return path


def config_for(row: Row, **overrides):
    from shoal.config import load_config

    sets = [f"model.n_layer={row.layers}", f"model.d_model={row.hidden}", f"model.n_head={row.heads}",
            f"model.seq_len={row.seq}", f"model.vocab_size={row.vocab}", f"train.global_batch_size={row.batch}",
            f"train.micro_batch_size={row.micro}", f'precision.dtype="{row.precision}"',
            f"precision.activation_checkpointing={'true' if row.recompute == 'full' else 'false'}",
            f"parallel.dp={row.dp}", f"parallel.tp={row.tp}", f"parallel.pp={row.pp}", f"parallel.zero={row.zero}",
            f'parallel.pp_schedule="{"interleaved-1f1b" if row.v > 1 else "1f1b"}"',
            f"parallel.pp_stages_per_rank={max(row.v, 2)}", 'data.source="tokens"', f'data.path="{token_file()}"',
            f"data.val_fraction={VAL_FRACTION}"]
    sets += [f"{k}={v}" for k, v in overrides.items()]
    return load_config(None, sets)


def profile_for(row: Row):
    from shoal.hardware import preset

    return preset(row.preset).model_copy(update={"network": row.network, "nproc": 8, "nnodes": row.gpus // 8})


def own_keys(row: Row) -> dict:
    return {"parallel.dp": row.dp, "parallel.tp": row.tp, "parallel.pp": row.pp, "parallel.zero": row.zero,
            "parallel.pp_schedule": "interleaved-1f1b" if row.v > 1 else ("1f1b" if row.pp > 1 else None),
            "precision.activation_checkpointing": row.recompute == "full", "train.micro_batch_size": row.micro}


def matches(keys: dict, own: dict) -> bool:
    return all(keys[k] == v for k, v in own.items() if v is not None)


@dataclass
class Planned:
    row: Row
    own: dict  # the row's own layout's time parts at the peak: compute, bubble, comm
    own_reason: str | None  # why the planner rejected the row's own layout (None: valid)
    others: list[dict]  # every valid layout's time parts, zero and ckpt (the own one among them when valid)
    seconds: float  # planner time
    own_memory: float | None = None  # the own layout's predicted peak bytes per rank
    cached: bool = False  # taken from an earlier run's plan (--cache)


def _plan_row(row: Row) -> Planned:
    from shoal.errors import UserError
    from shoal.layout import resolve_layout
    from shoal.plan.planner import Model, plan, predict

    cfg, profile = config_for(row), profile_for(row)
    started = time.perf_counter()
    planned = plan(cfg, row.gpus, profile, int(row.memory), cuda=True, fused_attention=row.fused_attention,
                   attention_dropout=row.attention_dropout, hidden_dropout=row.hidden_dropout)
    seconds = time.perf_counter() - started
    own_keys_ = own_keys(row)
    valid = [p for p in planned if p.ok]
    # every valid layout's time parts, with what the run's own stack chose for it (ZeRO, recomputation)
    others = [{**p.prediction.time, "zero": p.candidate.keys["parallel.zero"],
               "ckpt": p.candidate.keys["precision.activation_checkpointing"]} for p in valid]
    mine = next((p for p in planned if matches(p.candidate.keys, own_keys_)), None)
    reason = mine.reason if mine is not None else "not among the candidates"
    if mine is not None and mine.ok:
        return Planned(row, dict(mine.prediction.time), None, others, seconds, mine.prediction.memory["peak"])
    try:  # priced anyway, without the memory limit, to compare its time
        model = Model.build(cfg, row.fused_attention, row.attention_dropout, row.hidden_dropout, cuda=True)
        pred = predict(model, cfg, resolve_layout(cfg, row.gpus, True), profile)
    except UserError as e:  # a layout shoal cannot run at all: no prediction
        return Planned(row, {}, str(e), others, seconds)
    return Planned(row, dict(pred.time), reason, others, seconds, pred.memory["peak"])


def _cache_key(row: Row) -> str:
    """What a row's plan depends on: the row, shoal's source and this script's planning code."""
    h = hashlib.sha256(repr(row).encode())
    for f in sorted((ROOT / "src" / "shoal").rglob("*.py")):
        h.update(f.read_bytes())
    for fn in (config_for, profile_for, own_keys, _plan_row):
        h.update(inspect.getsource(fn).encode())
    return h.hexdigest()[:20]


def plan_row(row: Row, cache: bool = False) -> Planned:
    """The planner's plan of the row's model on its cluster, every layout at the vendor's peak; with
    `cache`, kept in the temporary directory under a key of the row and shoal's source (plans are
    deterministic: a 3,072-GPU row takes ~40 s)."""
    path = Path(tempfile.gettempdir()) / "shoal-published-runs" / f"{row.name}-{_cache_key(row)}.json"
    if cache and path.is_file():
        d = json.loads(path.read_text())
        return Planned(row, d["own"], d["own_reason"], d["others"], d["seconds"], d["own_memory"], cached=True)
    p = _plan_row(row)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"own": p.own, "own_reason": p.own_reason, "others": p.others,
                                    "seconds": p.seconds, "own_memory": p.own_memory}))
    return p


def at_efficiency(t: dict, efficiency: float) -> float:
    from shoal.plan.predict import step_at_efficiency

    return step_at_efficiency(t, efficiency)


def implied_efficiency(p: Planned) -> float | None:
    """The compute efficiency that makes the row's own prediction its reported time (None: communication
    alone already exceeds it)."""
    if not p.own:
        return None
    rest = p.row.reported_time() - p.own["comm"]
    return (p.own["compute"] + p.own["bubble"]) / rest if rest > 0 else None


def _rank(layouts: list[dict], predicted: float, eff: float) -> int:
    """1 + how many of `layouts` are predicted faster than `predicted` at compute efficiency `eff`."""
    return 1 + sum(1 for t in layouts if at_efficiency(t, eff) < predicted - 1e-12)


def score(planned: list[Planned]) -> list[dict]:
    implied = {p.row.name: implied_efficiency(p) for p in planned}
    out = []
    for p in planned:
        if not p.own:  # shoal cannot run the published layout: nothing to compare
            out.append({"row": p.row, "reason": p.own_reason, "err": None, "rank": None, "valid": len(p.others),
                        "seconds": p.seconds})
            continue
        others = [f for n, f in implied.items() if n != p.row.name and f is not None]
        eff = statistics.median(others) if others else 1.0
        predicted = at_efficiency(p.own, eff)
        err = p.row.reported_time() / predicted - 1  # on throughput per GPU
        rank = _rank(p.others, predicted, eff) if p.own_reason is None else None
        # among the layouts the run's own stack could choose from: its ZeRO stage and recomputation
        # (Megatron-LM in 2021 had no ZeRO; Table 1 recomputes every block)
        stack = [t for t in p.others if t["zero"] == p.row.zero and t["ckpt"] == (p.row.recompute == "full")]
        stack_rank = _rank(stack, predicted, eff) if p.own_reason is None else None
        out.append({"row": p.row, "eff": eff, "implied": implied[p.row.name], "predicted": predicted,
                    "stack_rank": stack_rank, "stack_valid": len(stack),
                    "pred_tflops": p.row.flops() / (predicted * p.row.gpus) / 1e12, "err": err, "rank": rank,
                    "valid": len(p.others), "reason": p.own_reason, "seconds": p.seconds, "parts": p.own,
                    "memory": p.own_memory or 0.0})
    return out


def zero3_bandwidth(r: dict) -> str:
    """What a ZeRO-3 row's reported time leaves for communication beyond the predicted compute, as a
    bandwidth: each GPU gathers the 16-bit parameters for every micro-batch's forward and backward and
    reduce-scatters the 16-bit gradients once (3 x 2 bytes x parameters a step at one micro-batch),
    against the bus bandwidth the planner prices its ring at."""
    from shoal.plan.network import network

    row = r["row"]
    params = 12 * row.layers * row.hidden ** 2 + (row.vocab + row.seq) * row.hidden
    n_micro = row.batch // (row.dp * row.micro)
    moved = (2 * n_micro + 1) * 2 * params
    left = row.reported_time() - (r["parts"]["compute"] + r["parts"]["bubble"]) / r["eff"]
    net = network(row.network)
    busbw = net.bus_bandwidth(8, row.gpus // 8)
    if left <= 0:
        return "the reported step leaves no time beyond the predicted compute"
    return (f"the reported step leaves {left:.1f} s beyond the predicted compute: {moved / 1e12:.2f} TB a GPU "
            f"moves a step at {moved / left / 1e9:.0f} GB/s, where the planner's ring runs at "
            f"{busbw / 1e9:.0f} GB/s bus bandwidth")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row names (default: all)")
    ap.add_argument("--cache", action="store_true",
                    help="reuse each row's plan from an earlier run of the same shoal source (temp dir)")
    args = ap.parse_args(argv)
    names = args.rows.split(",") if args.rows else None
    if names and (unknown := set(names) - {r.name for r in ROWS}):
        ap.error(f"--rows: no row named {', '.join(sorted(unknown))}; rows: {', '.join(r.name for r in ROWS)}")
    rows = [r for r in ROWS if names is None or r.name in names]
    started = time.perf_counter()
    planned = [plan_row(r, cache=args.cache) for r in rows]
    results = score(planned)
    print(f"{'row':18s} {'gpus':>5s} {'tp':>3s} {'pp':>3s} {'dp':>4s} {'v':>2s} {'mb':>3s} {'z':>2s} "
          f"{'reported':>9s} {'predicted':>9s} {'err':>7s} {'rank':>9s} {'stack':>7s} {'eff(loo)':>8s} {'implied':>7s} "
          f"{'comm s':>7s} {'GiB':>6s} {'plan s':>6s}")
    for r in results:
        row = r["row"]
        if r["err"] is None:
            print(f"{row.name:18s} {row.gpus:5d} {row.tp:3d} {row.pp:3d} {row.dp:4d} {row.v:2d} {row.micro:3d} "
                  f"{row.zero:2d} {row.reported_tflops():9.1f}  not expressible (below)")
            continue
        rank = f"{r['rank']}/{r['valid']}" if r["rank"] else "rejected"
        stack = f"{r['stack_rank']}/{r['stack_valid']}" if r["stack_rank"] else "-"
        implied = "-" if r["implied"] is None else f"{r['implied']:.3f}"
        print(f"{row.name:18s} {row.gpus:5d} {row.tp:3d} {row.pp:3d} {row.dp:4d} {row.v:2d} {row.micro:3d} "
              f"{row.zero:2d} {row.reported_tflops():9.1f} {r['pred_tflops']:9.1f} {r['err']:+7.1%} {rank:>9s} "
              f"{stack:>7s} {r['eff']:8.3f} {implied:>7s} {r['parts']['comm']:7.2f} {r['memory'] / 2 ** 30:6.1f} "
              f"{r['seconds']:6.1f}")
    print("TFLOP/s per GPU by the source's formula; err on throughput per GPU; rank among the valid layouts by "
          "predicted step time (1 = fastest); stack: among those with the run's own ZeRO stage and recomputation")
    for r in results:
        if r["reason"]:
            print(f"  {r['row'].name}: the planner rejects the published layout: {r['reason']}")
        for note in r["row"].notes:
            print(f"  {r['row'].name}: {note}")
    for r in results:
        if r["err"] is not None and r["row"].zero == 3:
            print(f"  {r['row'].name}: {zero3_bandwidth(r)}")
    scored = [r for r in results if r["err"] is not None]
    errs = [abs(r["err"]) for r in scored]
    ranks = [r["rank"] if r["rank"] else math.inf for r in scored]
    top5 = sum(1 for k in ranks if k <= 5)
    stack5 = sum(1 for r in scored if r["stack_rank"] and r["stack_rank"] <= 5)
    implied = [r["implied"] for r in scored if r["implied"] is not None]
    reused = sum(1 for p in planned if p.cached)
    print(f"{len(rows)} rows in {time.perf_counter() - started:.0f} s"
          f"{f' ({reused} plans reused from an earlier run: --cache)' if reused else ''}")
    print(f"RESULT published_median_err={statistics.median(errs):.3f} published_worst_err={max(errs):.3f} "
          f"published_rank_median={statistics.median(ranks):g} top5={top5}/{len(scored)} "
          f"top5_own_stack={stack5}/{len(scored)} "
          f"rows={len(scored)}/{len(results)} "
          f"efficiency={statistics.median(implied) if implied else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

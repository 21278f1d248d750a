"""The peer for memory_sharding.py: DeepSpeed ZeRO 1/2/3 on shoal's GPT, 2 CPU ranks over gloo, under torchrun.

Same model (configs/gpt-tiny.toml with the --set overrides given), AdamW with shoal's hyper-parameters
and parameter groups (decay on matrices only), gradient clipping, fp32, micro batch 1 of random byte
tokens. Prints one JSON line (rank 0): every rank's model-state bytes, peak RSS, and its step times.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 benchmarks/deepspeed_worker.py --stage 3 \
        --steps 5 --set model.n_layer=14 --set model.d_model=768 --set model.n_head=12
"""

import argparse
import json
import os
import resource
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shoal.config import load_config  # noqa: E402
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec  # noqa: E402

KINDS = ("params", "grads", "optimizer")
FIELDS = (*KINDS, "buckets", "peak")
ROOT = Path(__file__).resolve().parents[1]


def tensors_in(obj, depth: int = 0):
    """Every tensor in obj (a tensor, or lists / tuples / dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 4:
        for x in obj:
            yield from tensors_in(x, depth + 1)
    elif isinstance(obj, dict) and depth < 4:
        for x in obj.values():
            yield from tensors_in(x, depth + 1)


def held(model, zero) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, every byte counted once (byte
    ranges merged per storage; the first kind that names a byte gets it). The fp32 master partitions count
    as optimizer state, as in the ZeRO paper. Reduce buckets (communication buffers, allocated at
    reduce_bucket_size and touched only as far as used) are reported apart, as `buckets`."""
    params = list(model.parameters())
    a = zero.__dict__
    mangled = {k.rsplit("__", 1)[-1]: v for k, v in a.items() if "__" in k}  # stage 3's private buffers
    masters = [a.get("single_partition_of_fp32_groups"), a.get("fp32_partitioned_groups_flat")]  # 1/2, 3
    groups = {
        "params": [*params, *(getattr(p, "ds_tensor", None) for p in params), a.get("bit16_groups_flat"),
                   a.get("fp16_partitioned_groups_flat"), a.get("lp_param_buffer")],
        "grads": [*(p.grad for p in params), a.get("averaged_gradients"), a.get("grads_in_partition"),
                  a.get("grad_partitions_flat_buffer"), mangled.get("param_id_to_grad_partition"),
                  *(t.grad for t in tensors_in(masters))],
        "optimizer": [*masters, list(zero.optimizer.state.values())],
        "buckets": [a.get("ipg_buffer"), *(b.buffer for b in (a.get("ipg_buckets") or {}).values())],
    }
    ranges: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges counted so far
    out, before = {}, 0
    for kind in (*KINDS, "buckets"):
        for t in tensors_in(groups[kind]):
            if t is not None and t.numel():  # all of these are contiguous
                lo = t.storage_offset() * t.element_size()
                ranges.setdefault(t.untyped_storage().data_ptr(), []).append((lo, lo + t.nbytes))
        now = sum(union_bytes(r) for r in ranges.values())
        out[kind], before = now - before, now
    return out


def union_bytes(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, 0
    for lo, hi in sorted(ranges):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def dump(zero) -> None:
    """Debug: every tensor reachable from the ZeRO optimizer's attributes, by name."""
    for k, v in zero.__dict__.items():
        ts = [t for t in tensors_in(v) if t is not None]
        if ts:
            print(f"  {k}: {len(ts)} tensors, {sum(t.nbytes for t in ts) / 2**20:.1f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--dump", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as shoal: cores / local workers
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    cfg = load_config(str(ROOT / "configs/gpt-tiny.toml"), args.sets)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, DataSpec("tokens", vocab_size=256)).model
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2))
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "gradient_clipping": t.grad_clip, "zero_optimization": {"stage": args.stage},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    g = torch.Generator().manual_seed(rank)
    times, mem = [], {}
    for step in range(args.steps):
        t0 = time.perf_counter()
        w = torch.randint(256, (1, cfg.model.seq_len + 1), generator=g)
        logits = engine(w[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten())
        engine.backward(loss)
        if step == args.steps - 1:  # optimizer state exists since step 1; gradients are all here now
            mem = held(engine.module, zero)
            if args.dump and rank == 0:
                dump(zero)
        engine.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    mine = torch.tensor([float(mem[k]) for k in FIELDS[:-1]] + [float(peak)], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if rank == 0:
        per_rank = [{"rank": r, **{k: int(v) for k, v in zip(FIELDS, x.tolist(), strict=True)}}
                    for r, x in enumerate(every)]
        print(json.dumps({"memory_per_rank": per_rank, "step_times": times}), flush=True)
    dist.barrier()
    os._exit(0)  # skip gloo's exit-time destructors (they can abort)


if __name__ == "__main__":
    main()

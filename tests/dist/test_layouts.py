"""Every parallel layout trains the same model as one process: ZeRO 1/2/3, tensor and pipeline
parallelism and their hybrids (up to dp x tp x pp x ZeRO 3) against the single-process reference with
the same seed and global batch (fp32: losses within 1e-5 relative, final weights within 1e-5; bf16:
within the tolerance stated below), memory accounting that shows the sharding, and checkpoints that
reshard between layouts and world sizes. Runs in the in-process harness (tests/harness.py): the
layouts are the subject here, not the launcher.
"""

import json

import pytest
import torch

from conftest import read_metrics, read_weights
from harness import Ranks
from harness import train as train_on_ranks

STEPS = 6  # every step's loss is compared, and the final weights; the resharding tests resume at step 3
SAVED = 3
BASE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false", f"train.steps={STEPS}",
        "train.warmup_steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", f"train.val_interval={SAVED}",
        "metrics.log_interval=1", f"checkpoint.interval={SAVED}", "checkpoint.keep=2"]


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


# name -> (processes, overrides)
LAYOUTS = {"dp1": (1, []), "dp1-bf16": (1, ['precision.dtype="bf16"']),
           "dp2": (2, []), "dp4": (4, []), "dp2-zero1": (2, ["parallel.zero=1"]),
           "dp2-zero2": (2, ["parallel.zero=2"]), "dp2-zero3": (2, ["parallel.zero=3"]),
           # with the chunked loss: the head's weight is gathered by the root's forward, where the loss is taken
           "dp2-zero3-bf16": (2, ["parallel.zero=3", 'precision.dtype="bf16"', "model.loss_chunks=4"]),
           "tp2": (2, ["parallel.tp=2"]), "dp2-tp2": (4, ["parallel.tp=2"]),
           "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
           "dp2-tp2-zero3": (4, ["parallel.tp=2", "parallel.zero=3"]),
           # the split by measured time (any split trains the same model)
           "pp2-gpipe": (2, ["parallel.pp=2", 'parallel.pp_schedule="gpipe"', 'parallel.pp_balance="time"']),
           "pp2-1f1b": (2, ["parallel.pp=2", 'parallel.pp_schedule="1f1b"']),
           "pp2-interleaved": (2, ["parallel.pp=2", 'parallel.pp_schedule="interleaved-1f1b"']),
           "dp2-pp2": (4, ["parallel.pp=2"]),
           "dp2-pp2-zero3": (4, ["parallel.pp=2", "parallel.zero=3"]),
           "dp2-tp2-pp2-zero3": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.zero=3"]),
           "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
           # HSDP: 2 replicas of 2-rank shard groups (FSDP2 on a 2-D mesh); with tp 2 inside each rank pair
           "hsdp2x2-zero3": (4, ["parallel.zero=3", "parallel.dp_replicate=2"]),
           "hsdp2x2-zero2": (4, ["parallel.zero=2", "parallel.dp_replicate=2"]),
           "hsdp2x2-tp2-zero3": (8, ["parallel.zero=3", "parallel.dp_replicate=2", "parallel.tp=2"])}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ranks):
    """Each layout trained once per module: its run is compared with the reference and its step-3
    checkpoint is where the resharding tests start from. Returns (run dir, what rank 0 printed)."""
    cache = {}

    def run(layout):
        if layout not in cache:
            nproc, extra = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(layout) / "run"
            if layout in FRESH:
                pool = Ranks(nproc)
                try:
                    out = pool.run(train_on_ranks, [*BASE, *extra], str(run_dir))
                finally:
                    pool.close()
            else:
                out = ranks(nproc).run(train_on_ranks, [*BASE, *extra], str(run_dir))
            cache[layout] = (run_dir, out[0][1])
        return cache[layout]
    return run


# Layouts trained in processes of their own: torch's DTensor keeps meshes it has seen in caches keyed by their
# layout, not by their process groups, so in processes that trained dp2-tp2-pp2-zero3 a tensor-parallel
# DTensor of this 8-rank mesh of another shape resolved that earlier run's (destroyed) tp group by name:
# "Could not resolve the process group registered under the name 9" (reproduced with torch alone, without
# HSDP, in two init/destroy rounds of one process). A real run is one process per run.
FRESH = {"hsdp2x2-tp2-zero3"}


@pytest.fixture(scope="module")
def reference(trained):
    """One process, fp32 and bf16: the layouts below must train this same model."""
    return {"fp32": trained("dp1")[0], "bf16": trained("dp1-bf16")[0]}


def assert_same_training(run_dir, ref_dir, rtol, atol):
    ours, ref = losses(run_dir), losses(ref_dir)
    assert sorted(ours) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s] for s in sorted(ref)]), torch.tensor([ref[s] for s in sorted(ref)]),
                               rtol=rtol, atol=0)
    ref_w, w = read_weights(ref_dir), read_weights(run_dir)
    assert w.keys() == ref_w.keys()
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_matches_single_process(trained, reference, zero):
    run_dir, _ = trained(f"dp2-zero{zero}")
    assert_same_training(run_dir, reference["fp32"], rtol=1e-5, atol=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    mem = summary["memory_per_rank"]
    assert [r["rank"] for r in mem] == [0, 1]
    ref_mem = json.loads((reference["fp32"] / "summary.json").read_text())["memory_per_rank"][0]
    n_bytes = summary["parameters"] * 4
    assert ref_mem["params"] == n_bytes and ref_mem["optimizer"] >= 2 * n_bytes  # AdamW: two moments
    for r in mem:
        # the optimizer state is split between the 2 ranks (ZeRO 1 by whole parameters: roughly)
        assert 0.25 * ref_mem["optimizer"] < r["optimizer"] < 0.75 * ref_mem["optimizer"], mem
        if zero >= 2:  # FSDP2: parameters and gradients too, in even flat shards
            assert r["params"] <= n_bytes / 2 + 4096 and r["grads"] <= n_bytes / 2 + 4096, mem
        else:
            assert r["params"] == n_bytes and r["grads"] == n_bytes, mem


def slow(*names):
    """Cases left out of make test-fast (the fast tier keeps one of a kind)."""
    return [pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("layout", ["pp2-1f1b", *slow("pp2-gpipe", "pp2-interleaved", "dp2-pp2", "dp2-pp2-zero3",
                                                     "tp2-pp2", "dp2-tp2-pp2-zero3")])
def test_pipeline_layouts_match_single_process(trained, reference, layout):
    run_dir, out = trained(layout)
    assert_same_training(run_dir, reference["fp32"], rtol=1e-5, atol=1e-5)
    ref_val = [m["val_loss"] for m in read_metrics(reference["fp32"]) if "val_loss" in m]
    ours_val = [m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m]
    torch.testing.assert_close(torch.tensor(ours_val), torch.tensor(ref_val), rtol=1e-5, atol=0)
    assert "expected bubble" in out and "stage 1 (pp rank 1)" in out
    assert ("ms forward + backward" in out) == (layout == "pp2-gpipe"), out


@pytest.mark.parametrize("layout", ["tp2", *slow("tp2-sp", "dp2-tp2", "dp2-tp2-zero3")])
def test_tensor_parallel_layouts_match_single_process(trained, reference, layout):
    run_dir, _ = trained(layout)
    assert_same_training(run_dir, reference["fp32"], rtol=1e-5, atol=1e-5)
    mem = json.loads((run_dir / "summary.json").read_text())["memory_per_rank"]
    ref_mem = json.loads((reference["fp32"] / "summary.json").read_text())["memory_per_rank"][0]
    # every layer but the norms and position embedding is split in two: well under the whole model
    assert all(r["params"] < 0.7 * ref_mem["params"] for r in mem), mem


@pytest.mark.parametrize("layout", ["hsdp2x2-zero3", *slow("hsdp2x2-zero2", "hsdp2x2-tp2-zero3")])
def test_hsdp_matches_single_process_and_shards_within_a_replica(trained, reference, layout):
    """ZeRO 2/3 sharded over each replica's 2 ranks, replicated across the 2 replicas: the training of one
    process, each rank holding half the state (a quarter under plain ZeRO 3 over 4 ranks)."""
    run_dir, out = trained(layout)
    assert_same_training(run_dir, reference["fp32"], rtol=1e-5, atol=1e-5)
    mem = json.loads((run_dir / "summary.json").read_text())["memory_per_rank"]
    ref_mem = json.loads((reference["fp32"] / "summary.json").read_text())["memory_per_rank"][0]
    split = 4 if "tp2" in layout else 2  # tp halves the layers again
    for r in mem:
        assert r["optimizer"] < 0.6 * ref_mem["optimizer"] and r["params"] > 0.8 * ref_mem["params"] / split, mem


def test_zero3_bf16_matches_single_process_bf16(trained, reference):
    """bf16 compute: the one process casts under autocast, ZeRO 3 gathers bf16 parameters (FSDP2
    mixed precision), reduces gradients in fp32 and takes the loss in 4 chunks of tokens (model.loss_chunks;
    the one process over the whole logits). Stated tolerance: losses within 1e-2 relative;
    weights within 1e-2 absolute after 6 steps at a peak lr of 1e-3: Adam moves a weight by up to
    ~lr per step whatever the gradient's size, and bf16 rounding (8 mantissa bits) can flip the sign
    of the smallest gradients (measured: 4e-3 on a bias)."""
    assert_same_training(trained("dp2-zero3-bf16")[0], reference["bf16"], rtol=1e-2, atol=1e-2)


# save with the first layout at step 3, resume with the second, finish at step 6: the same run as the
# uninterrupted single-process reference (DCP reshards between plain, ZeRO 1, FSDP2, TP and pipeline
# state dicts). The first three pairs change only the world size (data parallelism, gradient
# accumulation keeps the global batch): losses within 1e-6 there, 1e-5 across sharding layouts.
@pytest.mark.parametrize("before,after,rtol", [
    ("dp2", "dp1", 1e-6), ("dp2", "dp2-zero3", 1e-5), ("dp2", "tp2", 1e-5),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("dp1", "dp2", 1e-6), ("dp2", "dp4", 1e-6), ("dp2-zero3", "dp1", 1e-5), ("dp2-zero1", "dp2-zero2", 1e-5),
        ("dp1", "dp2-zero1", 1e-5), ("tp2", "dp2-zero3", 1e-5), ("dp2", "dp2-pp2-zero3", 1e-5),
        ("pp2-interleaved", "dp1", 1e-5), ("dp2-zero3", "hsdp2x2-zero3", 1e-5),
        ("hsdp2x2-zero3", "dp2-zero3", 1e-5)]]])
def test_checkpoints_reshard_across_layouts(tmp_path, ranks, trained, reference, before, after, rtol):
    first, second = trained(before)[0], tmp_path / "second"
    nproc, extra = LAYOUTS[after]
    [(summary, out), *_] = ranks(nproc).run(train_on_ranks, [*BASE, *extra], str(second),
                                            str(first / "checkpoints" / f"step_{SAVED:08d}"))
    assert f"(step {SAVED})" in out
    assert sorted(losses(second)) == list(range(SAVED + 1, STEPS + 1))
    ref = losses(reference["fp32"])
    ours = losses(second)
    torch.testing.assert_close(torch.tensor([ours[s] for s in ours]), torch.tensor([ref[s] for s in ours]),
                               rtol=rtol, atol=0)
    ref_w = read_weights(reference["fp32"])
    for k, w in read_weights(second).items():
        torch.testing.assert_close(w, ref_w[k], rtol=0, atol=1e-5)

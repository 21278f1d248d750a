"""Each strategy checked on its own, in the in-process harness (tests/harness.py), against the
one-process computation or a hand-computed answer: a tensor-parallel layer against nn.Linear and the
GPT's whole plan against the unsplit model, one ZeRO 3 step against a plain step, a pipeline
schedule against its stages run in sequence, the step synchronisation against a hand-computed mean,
and the collectives and flags every step relies on."""

import copy
import math

import pytest
import torch

from shoal.config import load_config
from shoal.models.gpt import Block, GPTConfig, lm_loss
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec

TINY = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)
SPEC = DataSpec("tokens", vocab_size=256)


def tiny_gpt():
    torch.manual_seed(0)
    return build_model(TINY, SPEC)


def batch_of(n: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(256, (n, TINY.seq_len + 1), generator=g)
    return {"input": tokens[:, :-1], "target": tokens[:, 1:]}


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# --- tensor parallelism ------------------------------------------------------------------------------

def tp_linear_layers(env):
    """The GPT plan's split of one block: each projection holds its slice of the one-process
    nn.Linear (column-parallel: rows of the weight; row-parallel: columns), and the block computes the
    same output and input gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from shoal.models.gpt_parallel import tensor_parallel

    model = tiny_gpt().model
    ref = copy.deepcopy(model)
    tensor_parallel(model, 2, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    r, out = env.rank, {}
    for name in ("attn.q", "attn.k", "attn.v", "mlp.up", "attn.proj", "mlp.down"):
        mine, theirs = model.blocks[0].get_submodule(name), ref.blocks[0].get_submodule(name)
        assert isinstance(theirs, torch.nn.Linear)
        local = mine.weight.to_local()
        if name in ("attn.proj", "mlp.down"):  # row-parallel: this rank's input features
            want = theirs.weight[:, r * local.shape[1]:(r + 1) * local.shape[1]]
        else:  # column-parallel: this rank's output features (heads, hidden units)
            want = theirs.weight[r * local.shape[0]:(r + 1) * local.shape[0]]
        out[name] = torch.equal(local, want)
    x = torch.randn(2, TINY.seq_len, TINY.d_model, generator=torch.Generator().manual_seed(2), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = model.blocks[0](x), ref.blocks[0](x_ref)
    (y * y).sum().backward()
    (y_ref * y_ref).sum().backward()
    return out, (y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item()


def test_tensor_parallel_layers_hold_their_slice_of_nn_linear(ranks):
    for slices, out_diff, grad_diff in ranks(2).run(tp_linear_layers):
        assert all(slices.values()), slices
        assert out_diff < 1e-5 and grad_diff < 1e-5, (out_diff, grad_diff)


def tp_whole_model(env, sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh

    from shoal.parallel.clip import GradGroups, clip_grads, grad_norm, plain

    bundle = tiny_gpt()
    ref = copy.deepcopy(bundle.model)
    batch = batch_of(4)
    context = bundle.tensor_parallel(bundle.model, 2, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                                     sequence_parallel=sequence_parallel)
    with context():
        loss = plain(lm_loss(bundle.model, batch))
        loss.backward()
    ref_loss = lm_loss(ref, batch)
    ref_loss.backward()
    grads = dict(ref.named_parameters())
    worst = max((full(p.grad) - grads[n].grad).abs().max().item() for n, p in bundle.model.named_parameters())
    # clipped to a tenth of the norm: every gradient scaled alike, sequence parallelism's partial sums
    # (the norms' gains and biases) included
    params = GradGroups([(p, True) for p in bundle.model.parameters()])
    norm = grad_norm(params, None, torch.device("cpu"))
    clip_grads(params, 0.1 * norm.item(), norm)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1 * norm.item())
    clipped = max((full(p.grad) - grads[n].grad).abs().max().item() for n, p in bundle.model.named_parameters())
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), worst, clipped


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_tensor_parallel_plan_matches_the_unsplit_model(ranks, sequence_parallel):
    for loss_diff, grad_diff, clipped_diff in ranks(2).run(tp_whole_model, sequence_parallel):
        assert loss_diff < 1e-6 and grad_diff < 1e-5 and clipped_diff < 1e-6, (loss_diff, grad_diff, clipped_diff)


# --- ZeRO 3 ------------------------------------------------------------------------------------------

def zero3_step(env):
    """One AdamW step of a model sharded by ZeRO 3 (each rank half the batch) against the plain model
    stepping on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from shoal.parallel.zero import shard_parameters

    model = tiny_gpt().model
    ref = copy.deepcopy(model)
    batch = batch_of(4)
    count = batch["target"].numel()
    mine = {k: v[2 * env.rank:2 * env.rank + 2] for k, v in batch.items()}
    sharded = shard_parameters(model, (Block,), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), 3,
                               MixedPrecisionPolicy(), offload=False)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    (lm_loss(sharded, mine) * 2 / count).backward()  # FSDP averages over the 2 ranks: the sum's mean
    opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    (lm_loss(ref, batch) / count).backward()
    ref_opt.step()
    after = dict(ref.named_parameters())
    held = sum(p.to_local().numel() for p in sharded.parameters())
    worst = max((full(p.detach()) - after[n].detach()).abs().max().item() for n, p in sharded.named_parameters())
    return worst, held, sum(p.numel() for p in ref.parameters())


def test_zero3_step_matches_a_plain_step(ranks):
    results = ranks(2).run(zero3_step)
    for worst, held, total in results:
        assert worst < 1e-6, worst
        assert held <= total / 2 + 64, (held, total)  # each rank holds half (flat shards, padded)
    assert sum(held for _, held, _ in results) >= results[0][2]


# --- pipeline parallelism ----------------------------------------------------------------------------

def pipeline_step(env, schedule):
    """The pipeline (two stages, four micro-batches, tied embedding and head) against the same two stages
    run one after the other in one process on the whole batch."""
    from shoal.comm.collectives import Comm
    from shoal.layout import resolve_layout
    from shoal.parallel.apply import parallelize
    from shoal.parallel.precision import Precision

    cfg = load_config(None, ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.seq_len=16",
                             "parallel.pp=2", f"parallel.pp_schedule={schedule}", "train.global_batch_size=4",
                             "train.micro_batch_size=1"])
    bundle = tiny_gpt()
    ref = copy.deepcopy(bundle.model)
    layout = resolve_layout(cfg, 2, cuda=False)
    par = parallelize(bundle, layout, parallel=cfg.parallel, precision=cfg.precision, compile=False,
                      device=torch.device("cpu"), rank=env.rank, comm=Comm(env.store, env.rank, 2))
    batch = batch_of(4)
    count = batch["target"].numel()
    loss = par.forward_backward([batch], lambda: torch.tensor(1.0 / count), Precision("fp32", torch.device("cpu")))
    par.after_backward()
    stages = bundle.pipeline(ref)
    sizes = par.pipeline.split.sizes
    first, second = stages.build_stage(0, sizes[0]), stages.build_stage(sizes[0], sum(sizes))
    ref_loss = stages.output_loss(second(first(batch["input"])), batch["target"])
    (ref_loss / count).backward()
    grads = dict(ref.named_parameters())
    worst = max((full(p.grad) - grads[n].grad).abs().max().item() for n, p in par.model.named_parameters())
    return loss.item(), ref_loss.item(), worst, sorted(n for n, _ in par.model.named_parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedule_matches_stages_in_sequence(ranks, schedule):
    (loss0, ref0, worst0, names0), (loss1, ref1, worst1, names1) = ranks(2).run(pipeline_step, schedule)
    assert loss0 == 0.0 and loss1 == pytest.approx(ref1, rel=1e-6)  # the loss is known on the last stage
    assert worst0 < 1e-6 and worst1 < 1e-6, (worst0, worst1)
    assert "blocks.0.mlp.up.weight" in names0 and "blocks.1.mlp.up.weight" in names1
    assert "tok_emb.weight" in names0 and "tok_emb.weight" in names1  # the tied weight on both ends


# --- step synchronisation ----------------------------------------------------------------------------

def every_step_sync(env):
    """DDP with the every-step synchronisation installed: after one backward the gradients are the
    mean of what each rank's batch gives alone, computed here by hand from both ranks' batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shoal.comm.codecs import Codec
    from shoal.comm.collectives import Comm
    from shoal.parallel.data import grad_sync
    from shoal.parallel.sync import EveryStep

    model = tiny_gpt().model
    alone = [copy.deepcopy(model) for _ in range(2)]
    comm = Comm(env.store, env.rank, 2)
    ddp, log, sync = DDP(model), comm.log, EveryStep(Codec(comm))
    sync.install(ddp, None, log)
    batches = [batch_of(2, seed=10 + r) for r in range(2)]
    with grad_sync(ddp, sync.reduces(0, 1)):
        lm_loss(ddp, batches[env.rank]).backward()
    for m, b in zip(alone, batches, strict=True):
        lm_loss(m, b).backward()
    means = {n: (p0.grad + p1.grad) / 2 for (n, p0), (_, p1) in
             zip(alone[0].named_parameters(), alone[1].named_parameters(), strict=True)}
    worst = max((p.grad - means[n]).abs().max().item() for n, p in model.named_parameters())
    buckets = [r for r in log.records if "gradient bucket" in r["group"]]
    return (worst, len(buckets), all(r["done"] for r in buckets), sync.reduces(0, 2), sync.reduces(1, 2),
            comm.sync_bytes)


def test_every_step_sync_gives_the_mean_gradient(ranks):
    n_params = sum(p.numel() for p in tiny_gpt().model.parameters())
    for worst, n_buckets, finished, first, last, sent in ranks(2).run(every_step_sync):
        assert worst < 1e-6, worst
        assert sent == 4 * n_params  # fp32 gradients, all-reduced over 2 ranks: each sends 2 (w - 1) / w of them
        assert n_buckets >= 1 and finished  # the logged hook wrapped torch's all-reduce: recorded and completed
        assert (first, last) == (False, True)  # accumulation: only a step's last micro-batch reduces


# --- collectives and flags ---------------------------------------------------------------------------

def comm_basics(env):
    from shoal.comm.collectives import Comm
    from shoal.training.flags import StepFlags, agreed_flags

    comm = Comm(env.store, env.rank, env.world_size)
    agreed = comm.agree("choice", lambda: f"decided by rank {env.rank}")
    t = comm.all_reduce(torch.tensor([float(env.rank + 1)]), label="world, test")
    pending = comm.all_reduce(torch.tensor([1.0]), label="world, async test", async_op=True)
    value = pending.wait()
    gathered = comm.all_gather(torch.tensor([float(env.rank)]))
    flags = StepFlags(comm, torch.device("cpu"))
    norm = torch.tensor(math.inf if env.rank == 1 else 2.0, dtype=torch.float64)  # one rank's norm is not finite
    flags.start(torch.tensor(0.5 * (env.rank + 1), dtype=torch.float64), norm, stop=env.rank == 1, save=env.rank == 0)
    f = agreed_flags({**dict(zip(flags.names, flags.vector().tolist(), strict=True)), **flags.known})
    records = list(comm.log.records)
    return (agreed, t.item(), value.item(), [x.item() for x in gathered], (f.loss_sum, f.stop, f.bad_norm, f.save),
            all(r["done"] for r in records), sorted(comm.log.totals))


def test_comm_logs_times_and_agrees(ranks):
    results = ranks(2).run(comm_basics)
    for agreed, total, ones, gathered, flags, done, totals in results:
        assert agreed == "decided by rank 0"
        assert total == 3.0 and ones == 2.0 and gathered == [0.0, 1.0]
        assert flags == (1.5, True, True, True)  # any rank's stop, bad norm or save is everyone's
        assert done  # every record finished
        assert ("all_reduce", "world") in totals and ("all_gather", "world") in totals


def logged_compression_hook(env):
    """Hooks compose: torch's fp16 compression hook wrapped by comm.hooks.logged still averages (to
    fp16 precision) and every bucket is in the collective log, as a codec will be."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shoal.comm.hooks import logged
    from shoal.comm.log import CollectiveLog

    model = tiny_gpt().model
    alone = [copy.deepcopy(model) for _ in range(2)]
    ddp, log = DDP(model), CollectiveLog()
    ddp.register_comm_hook(None, logged(fp16_compress_hook, log, "dp, fp16"))
    batches = [batch_of(2, seed=20 + r) for r in range(2)]
    lm_loss(ddp, batches[env.rank]).backward()
    for m, b in zip(alone, batches, strict=True):
        lm_loss(m, b).backward()
    error, scale = 0.0, 0.0  # the largest error, against the largest mean gradient entry of the model
    for p, p0, p1 in zip(model.parameters(), alone[0].parameters(), alone[1].parameters(), strict=True):
        mean = (p0.grad + p1.grad) / 2
        error, scale = max(error, (p.grad - mean).abs().max().item()), max(scale, mean.abs().max().item())
    worst = error / scale
    records = [r for r in log.records if r["group"].startswith("dp, fp16, gradient bucket")]
    return worst, len(records), all(r["done"] for r in records)


def test_a_logged_hook_composes_with_compression(ranks):
    for worst, n, done in ranks(2).run(logged_compression_hook):
        assert worst < 2e-3, worst  # fp16 keeps 11 significant bits
        assert n >= 1 and done


def flight_recorder_summary(env):
    """comm/flight.py reads torch's real flight recorder: the live group, its ranks, its newest op, and
    a collective this rank issued that its peer has not joined yet. (gloo counts a collective
    completed only some time after its wait returns, so `completed` may lag; `enqueued` is exact.)"""
    import time

    import torch.distributed as dist

    from shoal.comm import flight

    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    first = flight.summary()
    if env.rank == 1:
        time.sleep(1.0)  # rank 0's next all-reduce cannot complete before rank 1 joins it
    work = dist.all_reduce(torch.ones(8), async_op=True)
    pending = flight.summary() if env.rank == 0 else None
    work.wait()
    return first, pending


def test_flight_recorder_summary_reads_torch_s_recorder(ranks):
    for rank, (first, pending) in enumerate(ranks(2).run(flight_recorder_summary)):
        (name, group), = first.items()  # only the live group, not those of earlier calls
        assert group["ranks"] == [0, 1] and group["last_op"] == "all_reduce ([4])"
        assert group["enqueued"] == 3 and group["completed"] <= 3
        if rank == 0:  # rank 1 had not joined: pending, with the time it was issued
            assert pending[name]["enqueued"] == 4 and pending[name]["completed"] <= 3
            assert pending[name]["last_op"] == "all_reduce ([8])" and pending[name]["pending_since"] > 0

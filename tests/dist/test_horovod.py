"""shoal's Horovod API (shoal.horovod) on two ranks in the harness:

- the collectives on known tensors: allreduce with every op and the scale factors (in place, async,
  grouped, an integer tensor), allgather with uneven first dimensions (and its gradient), alltoall with
  even and uneven splits, reducescatter of rows that do not divide, broadcast, objects, a codec;
- broadcast_optimizer_state: the other rank ends with rank 0's state and settings exactly;
- DistributedOptimizer on 2 ranks equals one process on the same global batch within 1e-5 (fp32),
  with backward_passes_per_step = 2 and a gradient_predivide_factor too; its misuse is one line;
- join: a rank out of data takes part in the other's steps with zeros;
- SyncBatchNorm equals BatchNorm over the whole batch (outputs, gradients, running statistics);
- hvd.elastic: a commit written to disk is what a restarted process resumes from (sync, reset callbacks),
  and the file goes once the elastic function returns; ElasticSampler splits what is left of an epoch.
"""

import pytest
import torch

from shoal.errors import UserError


def _hvd():
    import shoal.horovod as hvd

    hvd.init()  # adopts the harness's process group
    return hvd


# --- the collectives ---------------------------------------------------------------------------------

def reductions(env):
    hvd, r = _hvd(), env.rank
    t = torch.tensor([1.0, 2.0]) * (r + 1)
    out = {name: hvd.allreduce(t, op=op).tolist() for name, op in
           [("avg", hvd.Average), ("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max), ("prod", hvd.Product)]}
    out["default"] = hvd.allreduce(t).tolist()
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25).tolist()
    out["int"] = hvd.allreduce(torch.tensor([1, 2]) * (r + 1)).tolist()
    inplace = t.clone()
    out["same_object"] = hvd.allreduce_(inplace, op=hvd.Sum) is inplace and inplace.tolist() == [3.0, 6.0]
    handle = hvd.allreduce_async(t, op=hvd.Max)
    out["async"], out["poll"] = hvd.synchronize(handle).tolist(), hvd.poll(handle)
    out["grouped"] = [x.tolist() for x in hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)]
    out["input_kept"] = t.tolist()
    gen = torch.Generator().manual_seed(r)
    x = torch.randn(1000, generator=gen)
    every = [torch.randn(1000, generator=torch.Generator().manual_seed(q)) for q in range(2)]
    out["int8_error"] = float((hvd.allreduce(x, compression=hvd.Compression.int8) - sum(every) / 2).abs().max())
    out["fp16_error"] = float((hvd.allreduce(x, compression=hvd.Compression.fp16) - sum(every) / 2).abs().max())
    hvd.shutdown()
    return out


def test_allreduce_ops_factors_and_forms(ranks):
    for out in ranks(2).run(reductions):
        assert out["avg"] == out["default"] == [1.5, 3.0] and out["sum"] == [3.0, 6.0]
        assert out["min"] == [1.0, 2.0] and out["max"] == [2.0, 4.0] and out["prod"] == [2.0, 8.0]
        assert out["scaled"] == [1.5, 3.0]  # (2 x [1, 2] + 2 x [2, 4]) / 4
        assert out["int"] == [1, 3]  # [3, 6] / 2, an integer tensor rounded toward zero as Horovod does
        assert out["same_object"] and out["async"] == [2.0, 4.0] and out["poll"] is True
        assert out["grouped"] == [[3.0, 6.0], [6.0, 12.0]] and out["input_kept"] in ([1.0, 2.0], [2.0, 4.0])
        assert out["int8_error"] < 0.05 and out["fp16_error"] < 5e-3


def movements(env):
    hvd, r = _hvd(), env.rank
    out = {"gathered": hvd.allgather(torch.full((r + 1, 2), float(r))).tolist()}
    x = torch.ones(r + 1, 2, requires_grad=True)
    (hvd.allgather(x) * torch.arange(6.0).view(3, 2)).sum().backward()
    out["gather_grad"] = x.grad.tolist()
    try:
        hvd.allgather(torch.zeros(2, 3 + r))
    except UserError as e:
        out["mismatch"] = str(e)
    out["even"] = hvd.alltoall(torch.arange(4.0) + 10 * r).tolist()
    got, received = hvd.alltoall(torch.arange(3.0) + 10 * r, splits=[1, 2] if r == 0 else [2, 1])
    out["uneven"], out["received"] = got.tolist(), received.tolist()
    rows = torch.arange(10.0).view(5, 2) * (r + 1)
    out["rs_sum"] = hvd.reducescatter(rows, op=hvd.Sum).tolist()
    out["rs_avg"] = hvd.synchronize(hvd.reducescatter_async(rows)).tolist()
    t = torch.tensor([r + 1.0])
    out["bcast"], out["bcast_kept"] = hvd.broadcast(t, 1).tolist(), t.tolist()
    out["bcast_"] = hvd.broadcast_(torch.tensor([r + 5.0]), 0).tolist()
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["objects"] = hvd.allgather_object(("rank", r))
    hvd.barrier()
    hvd.shutdown()
    return out


def test_allgather_alltoall_reducescatter_broadcast(ranks):
    r0, r1 = ranks(2).run(movements)
    for out in (r0, r1):
        assert out["gathered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # 1 row from rank 0, 2 from rank 1
        assert "differ beyond the first dimension" in out["mismatch"] and "rank 1: [2, 4]" in out["mismatch"]
        assert out["bcast"] == [2.0] and out["object"] == {"from": 1} and out["objects"] == [("rank", 0), ("rank", 1)]
    # the gradient of an allgather: the averaged upstream gradient's rows of this rank (the same on both)
    assert r0["gather_grad"] == [[0.0, 1.0]] and r1["gather_grad"] == [[2.0, 3.0], [4.0, 5.0]]
    assert r0["even"] == [0.0, 1.0, 10.0, 11.0] and r1["even"] == [2.0, 3.0, 12.0, 13.0]
    assert (r0["uneven"], r0["received"]) == ([0.0, 10.0, 11.0], [1, 2])
    assert (r1["uneven"], r1["received"]) == ([1.0, 2.0, 12.0], [2, 1])
    # 5 rows over 2 ranks: 3 and 2 (Horovod's split); Sum = 3 x rows, Average = 1.5 x rows
    assert r0["rs_sum"] == [[0.0, 3.0], [6.0, 9.0], [12.0, 15.0]] and r1["rs_sum"] == [[18.0, 21.0], [24.0, 27.0]]
    assert r0["rs_avg"] == [[0.0, 1.5], [3.0, 4.5], [6.0, 7.5]] and r1["rs_avg"] == [[9.0, 10.5], [12.0, 13.5]]
    assert r0["bcast_kept"] == [1.0] and r0["bcast_"] == r1["bcast_"] == [5.0]


def optimizer_state(env):
    hvd, r = _hvd(), env.rank
    torch.manual_seed(r)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if r == 0 else 0.5, betas=(0.8, 0.9))
    if r == 0:  # only rank 0 has a state
        for _ in range(2):
            model(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    hvd.shutdown()
    return {"groups": sd["param_groups"], "state": {k: {n: v.clone() for n, v in s.items()}
                                                    for k, s in sd["state"].items()}}


def test_broadcast_optimizer_state_gives_every_rank_root_state_exactly(ranks):
    r0, r1 = ranks(2).run(optimizer_state)
    assert r1["groups"] == r0["groups"] and r1["groups"][0]["lr"] == 0.01
    assert r1["state"].keys() == r0["state"].keys() == {0, 1}
    for k in r0["state"]:
        for name, value in r0["state"][k].items():
            assert torch.equal(r1["state"][k][name], value), (k, name)


# --- DistributedOptimizer against one process ---------------------------------------------------------

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 2))


def batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(steps)]


def one_process(steps: int) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for x, y in batches(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def data_parallel(env, steps: int, passes: int, predivide: float):
    """Each rank trains on its half of every global batch of 8, in `passes` backward passes per step."""
    hvd, r = _hvd(), env.rank
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   gradient_predivide_factor=predivide)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in batches(steps):
        opt.zero_grad()
        for xs, ys in zip(x[4 * r:4 * r + 4].chunk(passes), y[4 * r:4 * r + 4].chunk(passes), strict=True):
            (torch.nn.functional.mse_loss(model(xs), ys) / passes).backward()
        opt.step()
    hvd.shutdown()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("passes,predivide", [(1, 1.0), (2, 2.0)])
def test_distributed_optimizer_equals_one_process(ranks, passes, predivide):
    want = one_process(5)
    for got in ranks(2).run(data_parallel, 5, passes, predivide):
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, rtol=0, atol=1e-5), (g - w).abs().max()


def clipping_and_misuse(env):
    hvd, r = _hvd(), env.rank
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
    out = {}
    try:
        opt.zero_grad()
    except UserError as e:
        out["zero_grad"] = str(e)
    opt.synchronize()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    out["norm"] = float(norm)
    opt.zero_grad()
    model(x).sum().backward()
    try:
        model(x).sum().backward()
    except UserError as e:
        out["passes"] = str(e)
    hvd.shutdown()
    return out


def test_synchronize_then_clip_and_misuse_is_one_line(ranks):
    r0, r1 = ranks(2).run(clipping_and_misuse)
    model = make_model()
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for out in (r0, r1):
        assert out["norm"] == pytest.approx(want, rel=1e-5)  # the norm of the averaged gradient on both ranks
        assert out["zero_grad"].startswith("optimizer.zero_grad() was called after loss.backward()")
        assert "more than backward_passes_per_step=1 times" in out["passes"]


def uneven_data(env):
    """Rank 0 has 3 batches, rank 1 one: rank 1 joins after its step and shadows rank 0's other two."""
    hvd, r = _hvd(), env.rank
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for x, y in batches(3 if r == 0 else 1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        opt.step()
    last = hvd.join()
    hvd.shutdown()
    return last, [p.detach() for p in model.parameters()]


def test_join_shadows_the_steps_of_the_ranks_still_training(ranks):
    (last0, got0), (last1, got1) = ranks(2).run(uneven_data)
    assert last0 == last1 == 0
    # rank 0's steps: the first averages both halves, the next two its own half / 2 (rank 1 sends zeros);
    # rank 1 stepped once (a joined rank's optimizer does not step, as in Horovod)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after = []
    for i, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        halves = [(x[:4], y[:4]), (x[4:], y[4:])] if i == 0 else [(x[:4], y[:4])]
        (sum(torch.nn.functional.mse_loss(model(a), b) for a, b in halves) / 2).backward()
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    for g0, g1, w0, w1 in zip(got0, got1, after[2], after[0], strict=True):
        assert torch.allclose(g0, w0, rtol=0, atol=1e-6) and torch.allclose(g1, w1, rtol=0, atol=1e-6)


def sync_batch_norm(env):
    hvd, r = _hvd(), env.rank
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 3, 4, 4, generator=gen) * 3 + 1, torch.randn(8, 3, 4, 4, generator=gen)
    bn = hvd.SyncBatchNorm(3)
    torch.nn.init.normal_(bn.weight, generator=gen)
    mine = x[4 * r:4 * r + 4].clone().requires_grad_()
    y = bn(mine)
    (y * w[4 * r:4 * r + 4]).sum().backward()
    out = (y.detach(), mine.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var)
    hvd.shutdown()
    return out


def test_sync_batch_norm_equals_batch_norm_over_the_whole_batch(ranks):
    got = ranks(2).run(sync_batch_norm)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 3, 4, 4, generator=gen) * 3 + 1, torch.randn(8, 3, 4, 4, generator=gen)
    bn = torch.nn.BatchNorm2d(3)
    torch.nn.init.normal_(bn.weight, generator=gen)
    x.requires_grad_()
    y = bn(x)
    (y * w).sum().backward()
    close = dict(rtol=0, atol=1e-5)
    for r, (yr, xg, _, _, mean, var) in enumerate(got):
        assert torch.allclose(yr, y.detach()[4 * r:4 * r + 4], **close) and torch.allclose(xg, x.grad[4 * r:4 * r + 4], **close)
        assert torch.allclose(mean, bn.running_mean, **close) and torch.allclose(var, bn.running_var, **close)
    # a parameter's gradient: each rank's share of the whole batch's (DistributedOptimizer averages them)
    assert torch.allclose(got[0][2] + got[1][2], bn.weight.grad, **close)
    assert torch.allclose(got[0][3] + got[1][3], bn.bias.grad, **close)


# --- hvd.elastic ----------------------------------------------------------------------------------------

def elastic_attempt(env, folder: str, first: bool):
    """One attempt of a job: the first commits, changes more and fails; the second is a restarted process."""
    import itertools
    from pathlib import Path

    from shoal.horovod.elastic import commits
    from shoal.horovod.elastic import state as state_module

    hvd, r = _hvd(), env.rank
    commits.launch_folder = lambda: Path(folder)  # a launcher's folder (the store's agreement: the CLI test's)
    state_module._made = itertools.count()  # a new process counts its TorchStates from 0
    torch.manual_seed(10 * r + (0 if first else 1))  # every attempt and rank starts from other weights
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=4)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, history=[])
    out = {"resets": []}
    state.register_reset_callbacks([lambda: out["resets"].append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        out.update(epoch=state.epoch, history=list(state.history), indices=list(iter(state.sampler)),
                   weight=state.model.weight.detach().clone())
        if first:
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            state.epoch, state.history = 1, [0.5, 0.25]
            state.sampler.record_batch(0, 2)
            state.commit()
            out["committed"] = state.model.weight.detach().clone()
            state.epoch = 7  # not committed: restore() in memory, and a restart, forget it
            state.restore()
            out["restored_epoch"] = state.epoch
            raise RuntimeError("the job fails here")  # the elastic function does not return: the commit stays
        with torch.no_grad():
            state.model.weight.zero_()
        state.restore()  # in memory: the commit every rank took at the sync
        out["restored_weight"] = state.model.weight.detach().clone()

    try:
        train(state)
    except RuntimeError:
        pass
    out["file"] = (Path(folder) / f"rank{r}-state0.pt").is_file()
    hvd.shutdown()
    return out


def test_elastic_commit_survives_a_restart_and_goes_after_success(ranks, tmp_path):
    import random

    folder = tmp_path / "launch"
    first = ranks(2).run(elastic_attempt, str(folder), True)
    assert all(f["file"] and f["restored_epoch"] == 1 and f["resets"] == [] for f in first)
    second = ranks(2).run(elastic_attempt, str(folder), False)
    order = list(range(10))
    random.Random(4).shuffle(order)
    for out in second:
        assert out["epoch"] == 1 and out["history"] == [0.5, 0.25] and out["resets"] == [2]
        assert torch.equal(out["weight"], first[0]["committed"]) and not out["file"]
        assert torch.equal(out["restored_weight"], first[0]["committed"])
        assert len(out["indices"]) == 3  # 10 samples, 4 of this epoch processed (2 x 2 ranks): 3 each of the 6 left
    assert sorted(second[0]["indices"] + second[1]["indices"]) == sorted(order[4:])
    assert not folder.exists()  # the elastic function returned: its commits (and their folder) are gone

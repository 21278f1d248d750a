"""Expert parallelism's dispatch (parallel/experts.py) against one process: a mixture-of-experts layer whose E
experts are split over the ranks, each rank routing its own tokens to the experts' ranks by all-to-all with uneven
splits and back, gives every rank's tokens the outputs the whole layer gives them, and every expert the weight
gradient of all the tokens that chose it (fp32: the largest difference within 1e-6 of the largest value; the
outputs came out equal, the gradients add the same terms in another order). Runs in the in-process harness."""

import pytest


def split_against_whole(env, keys: dict, rows: int, bf16: bool = False) -> dict:
    """On each rank: the whole layer over every rank's batch (the reference, the same on all), and the layer split
    over the ranks over this rank's batch; the largest differences of outputs and gradients. `bf16`: both under
    CPU autocast to bf16; then also the dtypes the all-to-alls sent."""
    import contextlib
    import copy

    import torch

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    from shoal.comm.collectives import Comm
    from shoal.models import moe
    from shoal.parallel.experts import ExpertLayout

    torch.manual_seed(0)
    cfg = moe.MoEConfig(**{"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, **keys})
    whole = moe.MoE(cfg).train()
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    split = copy.deepcopy(whole)
    comm = Comm(env.store, env.rank, env.world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("dp",))
    ExpertLayout(split, env.world_size, mesh, comm)  # one ep group of every rank
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(rows, 16, 32, generator=g) for _ in range(env.world_size)]
    weights = [torch.randn(rows, 16, 32, generator=g) for _ in range(env.world_size)]

    ref_out, ref_loss = [], 0
    for x, w in zip(batches, weights, strict=True):
        with autocast:
            ref_out.append(whole(x).float())
        ref_loss = ref_loss + (ref_out[-1] * w).sum() + (whole.aux if whole.aux is not None else 0)
    ref_loss.backward()
    with autocast:
        out = split(batches[env.rank]).float()
    ((out * weights[env.rank]).sum() + (split.aux if split.aux is not None else 0)).backward()

    n = split.experts.w_gate.to_local().shape[0]  # this rank's experts
    local = slice(env.rank * n, (env.rank + 1) * n)
    def rel(ours, theirs) -> float:
        return ((ours - theirs).abs().max() / theirs.abs().max()).item()

    diffs = {"out": rel(out, ref_out[env.rank])}
    for name in ("w_gate", "w_up", "w_down"):
        diffs[name] = rel(getattr(split.experts, name).grad.to_local(), getattr(whole.experts, name).grad[local])
    router = split.router.weight.grad.clone()  # each rank's share: summed over the ranks, as dp's all-reduce does
    comm.all_reduce(router)
    diffs["router"] = rel(router, whole.router.weight.grad)
    diffs["received"] = split.counts.sum().item() if split.counts is not None else 0
    diffs["sent"] = sorted({r["shapes"][0].split()[-1] for r in comm.log.records
                            if r["group"] == "ep" and r["op"] == "all_to_all" and r["shapes"][0].count(",")})
    return diffs


@pytest.mark.parametrize(("world", "keys", "rows"), [
    (2, {"experts": 4, "top_k": 2}, 3),
    pytest.param(2, {"experts": 4, "top_k": 2, "score": "sigmoid", "shared_experts": 1, "z_loss_coef": 1e-3}, 2,
                 marks=pytest.mark.slow),
    pytest.param(2, {"experts": 4, "top_k": 1, "capacity_factor": 1.0}, 3,  # choices dropped before they travel
                 marks=pytest.mark.slow),
    pytest.param(4, {"experts": 8, "top_k": 3, "grouped_mm": False}, 1,  # the batched product; one sequence a rank
                 marks=pytest.mark.slow),
], ids=["ep2", "ep2-sigmoid-shared", "ep2-capacity", "ep4-batched"])
def test_split_experts_give_every_token_and_expert_what_the_whole_layer_gives(ranks, world, keys, rows):
    results = ranks(world).run(split_against_whole, keys, rows)
    for rank, diffs in enumerate(results):
        assert all(v < 1e-6 for k, v in diffs.items() if k not in ("received", "sent")), f"rank {rank}: {diffs}"
        assert diffs["received"] == rows * 16 * keys["top_k"], (rank, diffs)  # its own tokens' choices, counted
        assert diffs["sent"] == ["float32"]


def test_under_bf16_autocast_the_rows_travel_in_bf16_and_the_outputs_are_the_whole_layer_s(ranks):
    """The experts compute in autocast's dtype: the dispatch sends the rows in it (half the bytes) and its outputs
    are the whole layer's, bitwise; the gradients within bf16's rounding of the products (the experts' weight
    gradients sum the same bf16 terms in another order)."""
    for rank, diffs in enumerate(ranks(2).run(split_against_whole, {"experts": 4, "top_k": 2}, 3, True)):
        assert diffs["out"] == 0 and diffs["sent"] == ["bfloat16"], (rank, diffs)
        assert all(diffs[k] < 2e-2 for k in ("w_gate", "w_up", "w_down", "router")), (rank, diffs)

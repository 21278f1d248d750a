"""The mixture-of-experts decoder (models/moe.py) in one process: routing, the grouped GEMM against the batched
product, dropless and capacity dispatch against a token-by-token reference, the balance and z-losses per sequence,
the loss-free bias, and the config's refusals."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from shoal.config import load_config
from shoal.errors import UserError
from shoal.models import moe
from shoal.models.spec import DataSpec

SPEC = DataSpec("tokens", vocab_size=256)


def config(**keys) -> moe.MoEConfig:
    base = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "experts": 4, "top_k": 2}
    return moe.MoEConfig(**{**base, **keys})


def layer(seed: int = 0, **keys) -> moe.MoE:
    torch.manual_seed(seed)
    m = moe.MoE(config(**keys))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def reference(m: moe.MoE, x: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its chosen experts one by one (kept: (B, T, k) which choices count)."""
    _, _, chosen, weights = m.route(x)
    out = torch.zeros_like(x)
    e = m.experts
    for b, t, j in torch.cartesian_prod(*(torch.arange(n) for n in chosen.shape)).tolist():
        if kept is not None and not kept[b, t, j]:
            continue
        i = chosen[b, t, j]
        h = F.silu(x[b, t] @ e.w_gate[i]) * (x[b, t] @ e.w_up[i])
        out[b, t] += weights[b, t, j] * (h @ e.w_down[i])
    return out + (m.shared(x) if m.shared is not None else 0)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_dispatch_equals_each_token_through_its_experts(score, shared):
    m = layer(score=score, shared_experts=shared).train()
    x = torch.randn(3, 16, 32)
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-5)


def test_the_grouped_gemm_and_the_batched_product_agree_in_values_and_gradients():
    x = torch.randn(40, 32)
    counts = torch.tensor([10, 0, 25, 5])  # an expert without tokens among them
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    w = torch.randn(4, 32, 16)
    assert moe.grouped_mm_fits(x, w)
    outs, grads = [], []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = moe.expert_matmul(xi, wi, offsets, counts, grouped)
        y.backward(torch.ones_like(y) + torch.arange(16.0))
        outs.append(y.detach())
        grads.append((xi.grad, wi.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-4)
    ref = torch.cat([x[0:10] @ w[0], x[10:35] @ w[2], x[35:40] @ w[3]])
    torch.testing.assert_close(outs[0], ref, rtol=1e-6, atol=1e-5)


def test_a_whole_layer_trains_alike_grouped_or_batched():
    x = torch.randn(2, 16, 32)
    results = []
    for grouped in (True, False):
        m = layer(grouped_mm=grouped).train()
        y = m(x)
        (y.square().sum() + m.aux).backward()
        results.append((y.detach(), [p.grad for p in m.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_a_capacity_keeps_each_sequences_first_choices_of_an_expert_and_drops_the_rest():
    cfg = config(capacity_factor=0.5)
    cap = cfg.capacity()
    assert cap == int(0.5 * 16 * 2 / 4) == 4
    m = layer(capacity_factor=0.5).train()
    x = torch.randn(2, 16, 32)
    _, _, chosen, _ = m.route(x)
    kept = m._within_capacity(chosen).view(chosen.shape)
    for b in range(2):
        for e in range(4):
            picks = [(t, j) for t in range(16) for j in range(2) if chosen[b, t, j] == e]
            want = [i < cap for i in range(len(picks))]  # token order
            assert [bool(kept[b, t, j]) for t, j in picks] == want
    assert not kept.all()  # 64 choices, 32 places: some are dropped
    torch.testing.assert_close(m(x), reference(m, x, kept), rtol=1e-5, atol=1e-5)


def test_the_balance_loss_is_switchs_per_sequence_and_sums_over_any_split_of_the_batch():
    m = layer(aux_loss_coef=0.01).train()
    x = torch.randn(4, 16, 32)
    m(x)
    whole = m.aux
    _, scores, chosen, _ = m.route(x)
    want = 0.0
    for b in range(4):
        f = torch.bincount(chosen[b].reshape(-1), minlength=4).float() / (16 * 2)
        p = scores[b].mean(0)
        want += 0.01 * 4 * (f * p).sum() * 16  # each sequence weighted by its 16 tokens
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-6)
    parts = 0.0
    for half in (x[:1], x[1:]):  # as two ranks, or two micro-batches, would take it
        m(half)
        parts = parts + m.aux
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)


def test_the_z_loss_is_the_squared_log_sum_exp_of_each_tokens_router_logits():
    m = layer(z_loss_coef=1e-3, balance="none").train()
    x = torch.randn(2, 16, 32)
    m(x)
    logits = m.router(x).float()
    torch.testing.assert_close(m.aux, 1e-3 * logits.logsumexp(-1).square().sum(), rtol=1e-5, atol=1e-6)
    m = layer(balance="none").train()
    m(x)
    assert m.aux is None


def test_the_loss_free_bias_moves_towards_the_experts_that_received_fewer_and_steers_the_choice():
    m = layer(balance="bias", bias_rate=0.1).train()
    x = torch.randn(4, 16, 32)
    m(x)
    m(x)
    counts = m.counts.clone()
    assert counts.sum() == 2 * 4 * 16 * 2
    assert m.aux is None  # no auxiliary loss with the bias
    m.move_bias()
    assert m.counts is None
    torch.testing.assert_close(m.expert_bias, 0.1 * torch.sign(counts.mean() - counts))
    # the bias chooses; the weights stay the scores'
    m.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    _, scores, chosen, weights = m.route(x)
    assert set(chosen.unique().tolist()) == {0, 1}
    torch.testing.assert_close(weights, scores.gather(-1, chosen) / scores.gather(-1, chosen).sum(-1, keepdim=True))


def test_the_step_hook_moves_every_layers_bias_once_per_update():
    torch.manual_seed(0)
    model = moe.MoEGPT(config(balance="bias", dense_layers=1, n_layer=3), 256)
    layers = model.moe_layers()
    assert len(layers) == 2 and isinstance(model.blocks[0].mlp, moe.gpt.MLP)  # the first block dense
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_post_hook(moe.bias_balance(model))
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx).backward()
    opt.step()
    assert all(m.counts is None and m.expert_bias.abs().sum() > 0 for m in layers)
    assert moe.bias_balance(moe.gpt.GPT(config(), 256)) is None  # a model without experts: no hook


@pytest.mark.parametrize(("balance", "summed"), [("bias", [1, 2, 3]), ("aux_loss", [2])])
def test_without_the_bias_the_counts_are_summed_over_the_ranks_only_on_logged_steps(balance, summed):
    """The loss-free bias moves by the counts of every rank, every step; the auxiliary loss needs none of them, and
    the metrics read them on logged steps only: no collective on the others."""
    torch.manual_seed(0)
    model = moe.MoEGPT(config(balance=balance), 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done, reduced = [0], []
    opt.register_step_post_hook(moe.bias_balance(model, lambda t: reduced.append(done[0]), lambda: done[0],
                                                 read=lambda: done[0] == 2))
    idx = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        done[0] += 1
        model(idx, idx).backward()
        opt.step()
    assert reduced == summed
    assert all(sorted(m.stepped) == [2, 3] for m in model.moe_layers())  # each step's counts kept, summed or not


def test_the_model_adds_its_layers_losses_in_training_and_reports_the_language_loss_in_evaluation():
    torch.manual_seed(0)
    model = moe.build(config(z_loss_coef=1e-3), SPEC).model.train()
    idx = torch.randint(0, 256, (2, 16))
    trained = model(idx, idx)
    assert all(m.aux is None for m in model.moe_layers())  # taken into the loss
    language = moe.gpt.GPT.forward(model, idx, idx)  # the same forward without adding them
    aux = sum(m.aux for m in model.moe_layers())
    assert aux > 0
    torch.testing.assert_close(trained, language + aux, rtol=1e-6, atol=1e-5)
    model.eval()
    torch.testing.assert_close(model(idx, idx), language, rtol=1e-6, atol=1e-5)


def test_a_pipelines_stages_carry_their_layers_losses_into_the_backward_and_count_each_micro_batch_once():
    """The stages of moe.pipeline_layers run in turn (as a schedule runs them), the loss scaled by 0.25 as the
    step's scale: the same gradients as the whole model's loss (its layers' losses added) scaled so, the same
    summed losses, and each layer's counts those of the micro-batches only, though the first stage ran once more
    first (the schedule's pass that learns its shapes)."""
    torch.manual_seed(0)
    whole = moe.build(config(z_loss_coef=1e-3, n_layer=3, dense_layers=1), SPEC).model.train()
    staged = copy.deepcopy(whole)
    idx = torch.randint(0, 256, (2, 3, 16))  # 2 micro-batches
    total = sum(whole(i, i) for i in idx)
    (total * 0.25).backward()
    counts = [m.counts for m in whole.moe_layers()]
    layers = moe.pipeline_layers(staged)
    assert layers.costs[2] > layers.costs[1]  # block 1's experts count: top 2 of them, beside its attention
    first, last = layers.build_stage(0, 3), layers.build_stage(3, 5)  # embeddings, blocks 0-1 | block 2, head
    layers.carried.start(0.25)
    first(idx[0])  # the shape pass
    lm = 0
    for i in idx:
        loss = layers.output_loss(last(first(i)), i)
        (loss * 0.25).backward()
        lm = lm + loss.detach()
    carried = layers.carried.taken(2, torch.device("cpu"))
    torch.testing.assert_close(lm + carried, total.detach(), rtol=1e-6, atol=1e-5)
    for m, want in zip(staged.moe_layers(), counts, strict=True):
        assert torch.equal(m.counts, want) and m.aux is None
    for (name, p), q in zip(whole.named_parameters(), staged.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_flops_count_the_active_experts():
    cfg = config(experts=8, top_k=2, n_layer=3, dense_layers=1)
    bundle = moe.build(cfg, SPEC)
    dense = moe.gpt.build(moe.gpt.GPTConfig(n_layer=3, d_model=32, n_head=2, seq_len=16), SPEC)
    per_expert = 3 * 32 * cfg.hidden()
    params = sum(p.numel() for p in bundle.model.parameters())
    active = params - 2 * (8 - 2) * per_expert  # two MoE layers, six idle experts each
    want = 6 * (active - 16 * 32) * 16 + 12 * 3 * 16 * 32 * 16
    assert bundle.flops_per_sample == pytest.approx(want)
    assert dense.flops_per_sample != bundle.flops_per_sample


@pytest.mark.parametrize(("sets", "says"), [
    (["model.top_k=3", "model.experts=2"], "model.top_k (3) is above model.experts (2)"),
    (["model.dense_layers=4", "model.n_layer=4"], "model.dense_layers (4) leaves none of model.n_layer (4)"),
    (["model.capacity_factor=0.01"], "model.capacity_factor = 0.01 gives each expert 0 of a sequence's"),
])
def test_bad_routing_is_refused_in_one_line_naming_the_key(sets, says):
    with pytest.raises(UserError) as e:
        load_config(None, ['model.name="moe"', *sets])
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sequence_parallelism_is_refused_until_it_is_built():
    bundle = moe.build(config(dense_layers=1), SPEC)  # block 0 dense, block 1 a mixture of experts
    assert bundle.tensor_parallel(bundle.model, 2) is None  # tp 2 divides it (the check alone, without a mesh)
    with pytest.raises(UserError, match='parallel.sequence_parallel with model.name = "moe" is not built yet'):
        bundle.tensor_parallel(bundle.model, 2, sequence_parallel=True)
    # tp splits the attention and a dense block's MLP, never an MoE layer's experts or router
    split = {id(p) for p in bundle.tp_split(bundle.model)}
    names = [n for n, p in bundle.model.named_parameters() if id(p) in split]
    assert {"blocks.1.attn.q.weight", "blocks.0.mlp.up.weight"} <= set(names), names
    assert not any(n.startswith("blocks.1.mlp.") for n in names), names


def test_a_small_moe_learns_stdlib_text():
    from shoal.data.sources import build_source

    cfg = load_config(None, ['model.name="moe"', "model.n_layer=2", "model.d_model=64", "model.n_head=2",
                             "model.seq_len=64", "model.experts=4", "data.max_bytes=200000"])
    source = build_source(cfg.data, cfg.model.seq_len, 0)
    torch.manual_seed(0)
    model = moe.build(cfg.model, source.spec).model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        batch = source.train_batch(torch.arange(step * 8, step * 8 + 8))
        loss = model(batch["input"], batch["target"]) / batch["target"].numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(256) - 0.3 and sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_the_planner_traces_an_moe_as_if_its_choices_spread_evenly_and_plans_only_what_trains():
    from shoal.plan.planner import Model, plan

    cfg = load_config(None, ['model.name="moe"', "model.n_layer=2", "model.d_model=64", "model.n_head=2",
                             "model.seq_len=64", "model.experts=8", "model.top_k=2", "model.capacity_factor=1.0",
                             "data.max_bytes=200000"])
    model = Model.build(cfg)
    for micro in (1, 2, 4, 8):  # the fourth from the first three (cost.affine)
        for dtype in (None, torch.bfloat16):
            forward = model.cost(micro, dtype).forward_flops  # the active experts' products, as gpt.flops counts
            assert forward == pytest.approx(model.bundle.flops_per_sample * micro / 3, rel=0.01), (micro, dtype)
    assert all(m.counts is None for m in model.bundle.model.moe_layers())  # the trace counted nothing
    planned = plan(cfg, 2, None, None)
    valid = {(p.candidate.layout.dims.dp, p.candidate.layout.dims.tp, p.candidate.layout.dims.pp) for p in planned
             if p.ok}
    assert valid == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}, [p.candidate for p in planned if p.ok]


@pytest.mark.slow  # imports transformers
def test_a_hugging_face_mixture_of_experts_trains_with_its_routers_balance_loss_as_transformers_adds_it():
    pytest.importorskip("transformers")
    from shoal.models.hf import causal_lm_loss
    from shoal.models.registry import build_model

    config = ('model.config={model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=32, '
              'num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, '
              'max_position_embeddings=64, output_router_logits=true, router_aux_loss_coef=0.01}')
    cfg = load_config(None, ['model.name="hf"', "model.seq_len=16", config])
    torch.manual_seed(0)
    model = build_model(cfg.model, SPEC).model.train()
    idx = torch.randint(0, 256, (2, 16))
    target = idx.clone()
    target[0, :4] = -1  # not counted
    batch = {"input": idx, "target": target}
    out = model(input_ids=idx, labels=None, use_cache=False)
    ce = F.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=-1, reduction="sum")
    assert out.aux_loss > 0
    torch.testing.assert_close(causal_lm_loss(model, batch), ce + 0.01 * out.aux_loss * 28, rtol=1e-5, atol=1e-5)
    model.eval()
    torch.testing.assert_close(causal_lm_loss(model, batch), ce, rtol=1e-5, atol=1e-5)


def test_a_forward_run_again_by_activation_checkpointing_is_not_counted_twice():
    from torch.utils.checkpoint import checkpoint

    m = layer(z_loss_coef=1e-3).train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = checkpoint(m, x, use_reentrant=False)
    first = m.aux
    y.sum().backward()
    assert m.counts.sum() == 2 * 16 * 2  # once, not again in the backward
    assert m.aux is first  # the losses taken by the first forward, not replaced by the one run again


@pytest.mark.parametrize(("sets", "world", "says"), [
    (["parallel.ep=2"], 2, 'parallel.ep = 2 splits a mixture of experts\' experts, but model.name = "gpt" has none'),
    (['model.name="moe"', "model.experts=6", "parallel.ep=4"], 4, "parallel.ep (4) must divide model.experts (6)"),
    (['model.name="moe"', "parallel.ep=4"], 2, "parallel.ep (4) must divide the data-parallel ranks (dp 2)"),
    (['model.name="moe"', "parallel.ep=2", "parallel.zero=1"], 2, "parallel.zero = 1 is not built yet"),
    (['model.name="moe"', "parallel.ep=2", 'sync.mode="local-sgd"', "sync.every=4"], 2,
     'not yet with sync.mode = "local-sgd"'),
])
def test_bad_expert_parallelism_is_refused_in_one_line_before_any_worker_starts(sets, world, says):
    from shoal.layout import resolve_layout

    with pytest.raises(UserError) as e:
        resolve_layout(load_config(None, sets), world, cuda=False)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_balance_is_in_the_profile_and_the_report():
    """summary.json's profile keeps each MoE layer's median imbalance over the logged steps (the first, which
    warms up, left out); `shoal report` draws each layer's imbalance over the steps, and no figure for a run
    without experts."""
    pytest.importorskip("matplotlib")
    from shoal.metrics.profile import summarize_profile
    from shoal.report.data import Run
    from shoal.report.figures import experts

    rows = [{"step": s, "time_compute_s": 0.1, "expert_imbalance": [i, 2 * i]}
            for s, i in ((1, 9.0), (2, 1.2), (3, 1.4), (4, 1.3))]
    assert summarize_profile(rows)["median_expert_imbalance"] == [1.3, 2.6]
    assert "median_ep_imbalance" not in summarize_profile(rows)
    assert summarize_profile([{**r, "ep_imbalance": [1.1]} for r in rows])["median_ep_imbalance"] == [1.1]
    assert "median_expert_imbalance" not in summarize_profile([{"step": 1, "time_compute_s": 0.1}])
    moe = Run(name="moe", path=None, rows=rows)
    fig = experts([moe])
    assert [line.get_label() for line in fig.axes[0].get_lines()][:2] == ["moe, MoE layer 0", "moe, MoE layer 1"]
    assert experts([Run(name="gpt", path=None, rows=[{"step": 1, "loss": 3.0}])]) is None


def test_dtensor_s_two_collectives_hint_is_left_out_for_the_experts_mesh_only():
    """DTensor warns, on every rank, that a redistribution over a two-axis mesh takes a collective per axis; under
    parallel.ep that mesh is shoal's own (edp, ep), and the hint is dropped there, and kept for any other mesh."""
    import logging
    from unittest import mock

    from torch.distributed.tensor import _redistribute

    from shoal.parallel.experts import EXPERT_MESH, _two_step_hint

    warn = getattr(_redistribute, "_warn_flatten_optimization_not_possible", None)
    if warn is None:
        pytest.skip("this torch's DTensor has no two-collectives warning")

    class Mesh:  # what the warning reads of a mesh
        def __init__(self, names):
            self.mesh_dim_names = names

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    # the warning is given once per mesh (by its hash: both meshes are kept alive, so that neither takes the
    # other's id), and whatever level earlier tests left torch's loggers at, it is let through here
    log, keep, meshes = logging.getLogger(_redistribute.__name__), Keep(), [Mesh(EXPERT_MESH), Mesh(("dp", "tp"))]
    level, disabled, everywhere = log.level, log.disabled, logging.root.manager.disable
    log.addFilter(_two_step_hint)
    log.addHandler(keep)
    log.setLevel(logging.WARNING)
    log.disabled = False
    logging.disable(logging.NOTSET)
    try:
        with mock.patch.object(_redistribute, "_warned_flatten_issues", set()):
            for mesh in meshes:
                warn(mesh, (0, 1), ("Partial",), ("Replicate",), 2, "all_reduce", "no_flattened_mesh")
    finally:
        log.removeFilter(_two_step_hint)
        log.removeHandler(keep)
        log.setLevel(level)
        log.disabled = disabled
        logging.disable(everywhere)
    assert len(seen) == 1 and '"dp", "tp"' in seen[0], seen

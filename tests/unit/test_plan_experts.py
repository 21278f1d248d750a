"""The planner's expert parallelism (parallel.ep, parallel/experts.py): `shoal plan` considers ep for a mixture of
experts (each divisor of dp that divides its experts, under ZeRO 0, 2 or 3), counts what a rank holds (ZeRO 0: its
experts / ep of each layer's experts; ZeRO 2/3: the whole model's state sharded over dp, as before, but only its
experts gathered for compute), and prices the all-to-alls: per MoE layer and micro-batch the counts and the rows
out and back in forward, the rows' gradients both ways in backward, the forward's three again under
recomputation; and the dispatch's own reordering and host reads as compute. The preflight counts a rank's state the same way (parallel/fit.py)."""

import pytest

from shoal.config import load_config
from shoal.hardware import HardwareProfile
from shoal.layout import resolve_layout
from shoal.parallel.fit import rank_memory
from shoal.plan.planner import Model, moe_exchange, plan, predict
from shoal.plan.predict import MoEExchange, _ep_comm, _ep_dispatch

MOE = ['model.name="moe"', "model.n_layer=3", "model.d_model=64", "model.n_head=2", "model.seq_len=64",
       "model.experts=8", "model.top_k=2", "model.dense_layers=1", "data.max_bytes=200000", "train.global_batch_size=8"]


def experts_and_rest(model: Model) -> tuple[int, int]:
    """Elements of the expert weights (the three-dimensional ones) and of everything else."""
    experts = sum(n for n, _, ndim, *_ in model.shape.params if ndim == 3)
    return experts, sum(n for n, *_ in model.shape.params) - experts


def test_ep_is_planned_for_a_mixture_of_experts_where_it_is_built():
    ok = {p.candidate.label() for p in plan(load_config(None, MOE), 4, None, None) if p.ok}
    assert {"dp4 tp1 pp1 ep2 zero0 mb1", "dp4 tp1 pp1 ep4 zero0 mb1", "dp4 tp1 pp1 ep2 zero3 mb1",
            "dp4 tp1 pp1 ep4 zero2 ckpt mb2"} <= ok
    assert not [label for label in ok if " ep" in label and "zero1" in label]  # ZeRO 1 with ep is not built
    gpt = load_config(None, ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32",
                             "data.max_bytes=200000", "train.global_batch_size=8"])
    assert not [p for p in plan(gpt, 4, None, None) if " ep" in p.candidate.label()]


def test_a_rank_holds_its_experts_and_gathers_only_those():
    """ZeRO 0 with ep 2: half of the experts' weights, gradients and AdamW state on a rank, the rest whole, as the
    preflight counts it too. ZeRO 3 with ep 2: the same state as without ep (the experts / ep sharded over dp / ep
    ranks is experts / dp), but the blocks gathered for compute hold half the experts."""
    def memory(*keys):
        cfg = load_config(None, [*MOE, *keys])
        model = Model.build(cfg)
        layout = resolve_layout(cfg, 2, False)
        return model, predict(model, cfg, layout, None).memory, rank_memory(model.shape, model.shape.params, layout,
                                                                            cfg)

    model, ep0, preflight = memory("parallel.ep=2")
    experts, rest = experts_and_rest(model)
    assert ep0["params"] == ep0["grads"] == 4 * (rest + experts // 2) == preflight["params"]
    _, z3, _ = memory("parallel.zero=3")
    _, z3_ep, preflight_z3 = memory("parallel.zero=3", "parallel.ep=2")
    assert z3_ep["params"] == z3["params"] == preflight_z3["params"]
    layer_experts = experts // 2  # two MoE layers: two blocks gathered at once hold one layer's experts each
    assert z3["buffers"] - z3_ep["buffers"] == 2 * 4 * layer_experts // 2


def test_the_all_to_alls_are_on_the_layer_s_path():
    """Per MoE layer and micro-batch: the counts and the rows out and back in forward, the rows' gradients back
    and out in backward; the forward's three again when recomputed. An all-to-all the probe did not measure is
    priced as a reduce-scatter of its bytes."""
    cfg = load_config(None, [*MOE, "parallel.ep=2"])
    layout = resolve_layout(cfg, 2, False)
    # 2 MoE layers; 4 x 64 tokens x top 2, 64 fp32 each; the counts: one int64 for each of the 8 experts
    assert moe_exchange(cfg, 4) == MoEExchange(2, 4 * 64 * 2, 64 * 4, 8, cast=False)
    # under a pipeline of 2 stages, a rank's stage holds one of them
    assert moe_exchange(load_config(None, [*MOE, "parallel.ep=2", "parallel.pp=2"]), 4).layers == 1
    ex = MoEExchange(2, 1000, 1000, 8)  # 1e6 bytes of rows
    a2a = HardwareProfile(matmul_flops={"fp32": 1e10}, collectives={"all_to_all": [(1.0, 1e-3), (1e12, 1e-3)]})
    assert _ep_comm(a2a, layout, 2, 3, ex, False) == pytest.approx(3 * 2 * (3 + 2) * 1e-3)
    assert _ep_comm(a2a, layout, 2, 3, ex, True) == pytest.approx(3 * 2 * (6 + 2) * 1e-3)
    linear = HardwareProfile(matmul_flops={"fp32": 1e10}, collectives={"all_to_all": [(1.0, 1e-9), (1e12, 1e3)]})
    more = (_ep_comm(linear, layout, 2, 3, MoEExchange(2, 1000, 1000, 256), False)
            - _ep_comm(linear, layout, 2, 3, ex, False))
    assert more == pytest.approx(3 * 2 * 8 * (256 - 8) * 1e-9)  # the counts: a message of 8 bytes an expert
    scatter = HardwareProfile(matmul_flops={"fp32": 1e10}, collectives={"reduce_scatter": [(1.0, 2e-3), (1e12, 2e-3)]})
    assert _ep_comm(scatter, layout, 2, 1, MoEExchange(1, 1000, 1000, 8), False) == pytest.approx(5 * 2e-3)
    bf16 = load_config(None, [*MOE, "parallel.ep=2", 'precision.dtype="bf16"'])
    # the rows travel in the compute dtype, cast to it from fp32 by the dispatch
    assert moe_exchange(bf16, 4) == MoEExchange(2, 4 * 64 * 2, 64 * 2, 8, cast=True)
    assert moe_exchange(load_config(None, ["data.max_bytes=200000"]), 4) is None


def test_the_dispatch_s_own_work_is_priced_as_compute():
    """Besides its all-to-alls, the dispatch reorders the rows (two gathers forward, two scatters into zeros
    backward: 12 bytes moved for each byte of rows) and builds the permutation (int64 vectors of a row's length),
    its forward again when recomputed; on a GPU three host reads a forward, each a launch the device waits for."""
    cpu = HardwareProfile(matmul_flops={"fp32": 1e10}, memory_bandwidth=1e10, op_overhead_s=0.0)
    rows = MoEExchange(1, 1000, 4000, 8)  # 4 MB of rows; the permutation's vectors 8 kB each
    once = _ep_dispatch(cpu, "fp32", 1, rows, False)
    moved = 12 * 4e6 + 4 * 8e3 + 19 * 8e3  # gathers and scatters; their indices; the permutation's operators
    assert once == pytest.approx(moved / 1e10)
    assert _ep_dispatch(cpu, "fp32", 3, MoEExchange(2, 1000, 4000, 8), False) == pytest.approx(6 * once)
    recomputed = _ep_dispatch(cpu, "fp32", 1, rows, True) - once
    assert recomputed == pytest.approx((4 * 4e6 + 2 * 8e3 + 19 * 8e3) / 1e10)  # the forward's part once more
    gpu = HardwareProfile(device="cuda", matmul_flops={"fp32": 1e12}, memory_bandwidth=1e15,
                          host_op_s=1e-3)
    # every operator issued by the host (11 forward, 4 backward) and three reads: the host's time, not the bytes'
    assert _ep_dispatch(gpu, "fp32", 1, rows, False) == pytest.approx((11 + 3 + 4) * 1e-3, rel=1e-2)


def test_an_imbalance_slows_the_expert_parallel_step_by_the_experts_share():
    """`shoal plan --expert-imbalance X`: under ep the other ranks wait for the rank whose experts took the most
    tokens, X times the mean: its experts' compute (their share of the FLOPs, counted from the config) is X times
    a balanced step's. Without ep every rank computes its own tokens' experts, whatever the balance."""
    from shoal.plan.planner import expert_share

    profile = HardwareProfile(matmul_flops={"fp32": 1e10}, memory_bandwidth=1e10,
                              collectives={"all_reduce": [(1.0, 1e-4)], "all_to_all": [(1.0, 1e-4)]})

    def compute(imbalance, *keys):
        cfg = load_config(None, [*MOE, *keys])
        model = Model.build(cfg)
        layout = resolve_layout(cfg, 2, False)
        return predict(model, cfg, layout, profile, imbalance=imbalance).time["compute"], model, cfg

    from shoal.plan.predict import _ep_dispatch, _optimizer_time

    balanced, model, cfg = compute(1.0, "parallel.ep=2")
    skewed, *_ = compute(1.5, "parallel.ep=2")
    share = expert_share(cfg, model.cost(1))
    assert 0.2 < share < 0.9  # the experts' products are much of this small model's FLOPs, not all
    layout = resolve_layout(cfg, 2, False)
    step = _optimizer_time(model.opt_ops, profile, "fp32", layout)  # and the dispatch's own, which waits for none
    step += _ep_dispatch(profile, "fp32", layout.per_rank_batch // layout.micro_batch,
                         moe_exchange(cfg, layout.micro_batch), False)
    assert (skewed - balanced) / (balanced - step) == pytest.approx(0.5 * share, rel=1e-9)
    assert compute(1.5)[0] == compute(1.0)[0]  # no ep: no wait for another rank's experts


def test_a_plan_refuses_an_imbalance_below_one(capsys):
    from shoal.cli import main

    assert main(["plan", "--expert-imbalance", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--expert-imbalance 0.5" in err and "at least 1" in err and err.count("\n") == 1, err


def test_under_tensor_parallelism_each_rank_computes_its_experts_whole(monkeypatch):
    """parallel.tp splits an MoE's attention, not its experts (moe.tensor_parallel): the planner, which prices a
    micro-batch's operators at 1 / tp of their work, adds back the experts' share (tp - 1) times, and calibrates
    the rest of the step only."""
    from shoal.plan import planner
    from shoal.plan.predict import _optimizer_time

    profile = HardwareProfile(matmul_flops={"fp32": 1e10}, memory_bandwidth=1e10,
                              collectives={"all_reduce": [(1.0, 1e-4)]})
    cfg = load_config(None, [*MOE, "parallel.tp=2"])
    model, layout = Model.build(cfg), resolve_layout(cfg, 2, False)
    assert layout.dims.tp == 2
    step = _optimizer_time(model.opt_ops, profile, "fp32", layout)
    whole = predict(model, cfg, layout, profile).time["compute"] - step
    share = planner.expert_share(cfg, model.cost(layout.micro_batch))
    monkeypatch.setattr(planner, "expert_share", lambda *_: 0.0)  # as if tp split the experts too
    split = predict(model, cfg, layout, profile).time["compute"] - step
    assert 0.2 < share < 0.9 and whole / split == pytest.approx(1 + share, rel=1e-9)
    # the probe's tp calibration, fitted to the reference GPT (all of whose work tp splits), leaves the experts'
    # whole compute alone: here 2 x the rest
    monkeypatch.undo()
    formulas = predict(model, cfg, layout, profile).time["step"]
    experts = 2 * (whole - split)  # of tp 2's compute at 1 / 2, the experts' share twice over
    calibrated = profile.model_copy(update={"calibration": {"tp": (2.0, 0.0)}})
    assert predict(model, cfg, layout, calibrated).time["step"] == pytest.approx(2 * (formulas - experts) + experts)


def test_the_plan_says_the_models_parameters_and_the_active_ones(capsys):
    """`shoal plan` names the model's parameters before its table, and a mixture of experts' active ones per token
    as `shoal train`'s first line does (ModelBundle.params_text): the dense part and top_k of each layer's experts."""
    from shoal.cli import main
    from shoal.models import moe

    assert main(["plan", *[a for k in MOE for a in ("--set", k)], "--nproc", "2", "--preset", "h100", "--top", "1"]) == 0
    cfg = load_config(None, MOE)
    bundle = Model.build(cfg).bundle
    total = sum(p.numel() for p in bundle.model.parameters())
    active = total - moe.idle_params(cfg.model)  # of 8 experts a layer, 6 a token does not pass
    assert f"model moe: {total:,} parameters, {active:,} active per token" in capsys.readouterr().out
    assert main(["plan", "--set", "data.max_bytes=200000", "--nproc", "2", "--preset", "h100", "--top", "1"]) == 0
    assert "active" not in capsys.readouterr().out.split("\n")[1]  # a dense model: its parameters alone


def test_an_imbalance_adds_the_busiest_ranks_expert_activations_to_its_memory():
    """Under ep the busiest rank's experts receive `imbalance` times the mean of the routed rows and keep, for each,
    its input row and three of the expert width for backward; with every block recomputed, in one layer only.
    Without ep a rank computes its own tokens' experts whatever the balance: nothing more."""
    from shoal.plan.planner import expert_activations

    def activations(imbalance, *keys):
        cfg = load_config(None, [*MOE, *keys])
        return predict(Model.build(cfg), cfg, resolve_layout(cfg, 2, False), None, imbalance=imbalance).memory

    # 4 x 64 tokens x top 2 rows a micro-batch (the layout's micro-batch of 4); d 64 and an expert width of 4 x 64 / 2
    per_layer = 4 * 64 * 2 * (64 + 3 * 128) * 4
    cfg = load_config(None, [*MOE, "parallel.ep=2"])
    assert resolve_layout(cfg, 2, False).micro_batch == 4
    assert expert_activations(cfg, 4, 1.5) == 0.5 * per_layer * 2  # 2 MoE layers
    balanced, skewed = activations(1.0, "parallel.ep=2"), activations(1.5, "parallel.ep=2")
    assert skewed["activations"] - balanced["activations"] == 0.5 * per_layer * 2
    assert skewed["peak"] > balanced["peak"]
    ckpt = load_config(None, [*MOE, "parallel.ep=2", "precision.activation_checkpointing=true"])
    assert expert_activations(ckpt, 4, 1.5) == 0.5 * per_layer
    assert activations(1.5)["activations"] == activations(1.0)["activations"]  # no ep


def test_expert_parallelism_is_planned_under_hsdp_too():
    """On several nodes the plan considers HSDP (ZeRO 2/3 within a node, replicated across), and ep with it."""
    from shoal.hardware import preset

    cfg = load_config(None, MOE)
    profile = preset("h100").model_copy(update={"nproc": 2, "nnodes": 2})
    planned = plan(cfg, 4, profile, None)
    hsdp = [p.candidate.label() for p in planned
            if p.ok and p.candidate.layout.dims.dp_replicate == 2 and p.candidate.cfg.parallel.ep == 2]
    assert hsdp, [(p.candidate.label(), p.reason) for p in planned if p.candidate.keys.get("parallel.ep") == 2][:5]

"""The planner on a GPU, tested on the CPU: the trace under autocast (each tensor in the dtype a GPU run gives
it), the working set it follows from operator to operator, the memory a GPU holds beyond its tensors, the
kernels' times by kind and size, and the predictions against what one H100 measured (issue rows, held
within the stated tolerances: a reference from another machine)."""

import json
import math
from pathlib import Path

import pytest
import torch

from shoal.config import load_config
from shoal.hardware import HardwareProfile, preset
from shoal.layout import resolve_layout
from shoal.plan.check import check_run
from shoal.plan.kernels import K_FILL, MATMUL_EFFICIENCY, TILE, kernel_seconds, matmul_seconds
from shoal.plan.planner import Model, plan, predict, predict_config
from shoal.plan.predict import device_beyond

B, T, V, D = 2, 64, 512, 64
TINY = ["model.n_layer=2", f"model.d_model={D}", "model.n_head=2", f"model.seq_len={T}", f"model.vocab_size={V}",
        "data.max_bytes=200000", f"train.global_batch_size={B}", f"train.micro_batch_size={B}", 'precision.dtype="bf16"']
H100 = preset("h100").model_copy(update={"nproc": 1})
GIB = 2 ** 30
FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def model():
    return Model.build(load_config(None, TINY), cuda=True)


def test_autocast_gives_the_loss_fp32_and_the_products_16_bits(model):
    """Under bf16 autocast the logits' log-probabilities are fp32 (B T V x 4 bytes saved for backward) and
    the products' outputs bf16: the saved activations are fewer bytes than the fp32 trace's, the loss's no
    fewer."""
    fp32, bf16 = model.cost(B), model.cost(B, torch.bfloat16)
    assert bf16.saved_outside >= 4 * B * T * V and sum(bf16.saved) < sum(fp32.saved)
    products = [[moved for name, _, moved in c.ops.items if name == "mm"] for c in (fp32, bf16)]
    assert products[0] and [2 * b for b in products[1]] == products[0]  # inputs and output in 16 bits


def test_the_working_set_is_the_loss_s_gradient_at_the_start_of_backward(model):
    """The most a GPT's forward and backward hold beyond what the forward saved: at the loss's backward, the
    fp32 log-probabilities' gradient and the logits' gradient (8 bytes a logit), with every gradient of a
    parameter yet to come (grads_at_peak 0). On the fp32 trace the same 8 bytes a logit."""
    for autocast in (None, torch.bfloat16):
        cost = model.cost(B, autocast)
        assert cost.working == pytest.approx(8 * B * T * V, rel=0.1), autocast
        assert cost.grads_at_peak == 0.0


def test_the_chunked_loss_holds_one_chunk_s_logits():
    """model.loss_chunks = 4: the logits never exist whole, nor their fp32 log-probabilities for backward: the
    working set holds one chunk's logits, their fp32 upcast and gradient, and the head's fp32 gradient (at this
    width as large as the chunk's logits)."""
    plain = Model.build(load_config(None, TINY), cuda=True).cost(B, torch.bfloat16)
    chunked = Model.build(load_config(None, [*TINY, "model.loss_chunks=4"]), cuda=True).cost(B, torch.bfloat16)
    assert chunked.working < 0.75 * plain.working
    # for backward it keeps the gradients of the head's input and weight (fp32) instead of the log-probabilities
    # and the head's input
    without = plain.saved_outside - 4 * B * T * V
    assert without < chunked.saved_outside <= without + 4 * (B * T * D + V * D) - 2 * B * T * D


def test_tensor_parallelism_splits_what_autocast_runs(model):
    """The products take the weights' 16-bit copies: the split is still found (the casts are the weights)."""
    bf16 = model.cost(B, torch.bfloat16)
    assert bf16.on_rank(1.0, 2, False)[1][0] < bf16.on_rank(1.0, 1, False)[1][0]
    assert bf16.row_parallel == model.cost(B).row_parallel > 0


def test_matrix_products_record_their_shapes(model):
    """(batch, m, n, k) of every product: the head's forward is B T tokens by the vocabulary over d_model."""
    shapes = set(model.cost(B, torch.bfloat16).ops.shapes.values())
    assert (1, B * T, V, D) in shapes and (1, B * T, D, D) in shapes and (1, D, V, B * T) not in shapes
    assert (1, D, D, B * T) in shapes  # a weight's gradient: d x d over the tokens


def test_autocast_costs_interpolate_as_traced():
    """Three traced sizes give any other's costs (working set, shapes, gradients at the peak included)."""
    cfg = load_config(None, TINY)
    model = Model.build(cfg, cuda=True)
    for m in (1, 2, 4):
        model.cost(m, torch.bfloat16)
    got, want = model.cost(8, torch.bfloat16), Model.build(cfg, cuda=True).cost(8, torch.bfloat16)
    assert model.at[torch.bfloat16] and got == want
    assert got.ops.shapes == want.ops.shapes and got.working == want.working


def test_a_matmul_runs_in_waves_of_tiles():
    """One tile more than the multiprocessors takes a second wave; a short inner dimension fills less."""
    peak, sms = 1e15, 132
    full = matmul_seconds(2 * (132 * TILE) * TILE * 8192, (1, 132 * TILE, TILE, 8192), peak, sms)
    assert full == pytest.approx(2 * 132 * TILE * TILE * 8192 / (peak * MATMUL_EFFICIENCY * 8192 / (8192 + K_FILL)))
    one_more = matmul_seconds(2 * (133 * TILE) * TILE * 8192, (1, 133 * TILE, TILE, 8192), peak, sms)
    assert one_more == pytest.approx(2 * full, rel=1e-9)  # two waves, the second nearly idle
    short = matmul_seconds(2 * 132 * TILE * TILE * K_FILL, (1, 132 * TILE, TILE, K_FILL), peak, sms)
    assert short * (8192 / K_FILL) == pytest.approx(full * 2 * 8192 / (8192 + K_FILL), rel=1e-9)


def test_kernels_by_kind_and_the_host_s_pace():
    """Memory-bound operators at 85% of the bandwidth; attention at its own fractions; kernels in one stream
    the host issues: small ones at the host's pace, a long one lets the host run ahead."""
    bw = H100.memory_bandwidth
    assert kernel_seconds("add", 0.0, 1e9, None, H100, "bf16") == pytest.approx(1e9 / (0.85 * bw))
    fwd = kernel_seconds("_scaled_dot_product_flash_attention_for_cpu", 1e12, 1e6, None, H100, "bf16")
    bwd = kernel_seconds("_scaled_dot_product_flash_attention_for_cpu_backward", 1e12, 1e6, None, H100, "bf16")
    assert fwd == pytest.approx(1e12 / (H100.matmul_flops["bf16"] * 0.5)) and bwd > fwd
    from shoal.plan.cost import Ops
    from shoal.plan.predict import DEFAULT_HOST_OP_S, op_time

    tiny = Ops([("add", 0.0, 1000.0)] * 10)
    small = 1000.0 / (0.85 * bw)
    assert op_time(tiny, H100, "bf16") == pytest.approx(10 * DEFAULT_HOST_OP_S + small)  # the host's pace
    big = 100 * DEFAULT_HOST_OP_S * 0.85 * bw  # a kernel as long as 100 launches
    ahead = Ops([("add", 0.0, big)] + [("add", 0.0, 1000.0)] * 10)
    # the ten small kernels were issued while the long one ran: they follow it at their own length
    assert op_time(ahead, H100, "bf16") == pytest.approx(DEFAULT_HOST_OP_S + 100 * DEFAULT_HOST_OP_S + 10 * small)


def test_a_gpu_holds_its_context_nccl_and_the_allocator_s_reserve():
    """device = peak + reserve + context + one NCCL communicator per group of more than one rank that is not
    the world, and the world's."""
    profile = H100.model_copy(update={"allocator_reserve": 1.1})
    cfg = load_config(None, [*TINY, "train.global_batch_size=8", "parallel.tp=2"])
    layout = resolve_layout(cfg, 8, True)  # dp 4 x tp 2
    out = device_beyond(profile, layout, 10 * GIB)
    assert out["reserve"] == GIB and out["context"] == 512 * 2 ** 20 and out["nccl"] == 3 * 2 ** 30
    assert out["device"] == 10 * GIB + GIB + 512 * 2 ** 20 + 3 * 2 ** 30
    one = resolve_layout(load_config(None, TINY), 1, True)
    assert device_beyond(profile, one, GIB)["nccl"] == 0


def test_memory_given_rejects_by_what_the_device_holds():
    """--memory against the device's total, not the tensors' peak alone."""
    cfg = load_config(None, TINY)
    pred = predict_config(cfg, 1, H100, cuda=True)
    assert pred.fit_bytes == pred.memory["device"] > pred.memory["peak"]
    between = (pred.memory["peak"] + pred.memory["device"]) // 2
    planned = {p.candidate.label(): p for p in plan(cfg, 1, H100, between, cuda=True)}
    assert not planned["dp1 tp1 pp1 zero0 mb2"].ok and "does not fit" in planned["dp1 tp1 pp1 zero0 mb2"].reason


def test_check_names_every_term_and_compares_what_a_gpu_measured(tmp_path):
    """plan --check on a GPU run: each term of the prediction named; the peak against the allocator's peak,
    the reserve, the context and NCCL, and the device's total against the run's measurements."""
    import tomli_w

    cfg = load_config(None, TINY)
    pred = predict_config(cfg, 1, H100, cuda=True)
    m = pred.memory
    raw = {}
    for item in TINY:
        key, value = item.split("=")
        raw.setdefault(key.split(".")[0], {})[key.split(".")[1]] = json.loads(value)
    (tmp_path / "config.toml").write_text(tomli_w.dumps(raw))
    row = {"rank": 0, **{k: m[k] for k in ("params", "grads", "optimizer")}, "peak": m["peak"],
           "reserved": int(m["peak"] * 1.25), "outside": 2 * m["context"]}
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 1, "median_step_time_s": 2 * pred.step_time,
                                                       "memory_per_rank": [row]}))
    rows = {name: (p, meas, err) for name, p, meas, err in check_run(tmp_path, H100)}
    assert {"activations (bytes)", "buffers (bytes)", "working (bytes)", "reserve (bytes)", "context + nccl (bytes)",
            "device (bytes)"} <= set(rows)
    assert rows["peak (bytes)"][2] == 0.0 and rows["step time (s)"][2] == pytest.approx(-0.5)
    assert rows["context + nccl (bytes)"][2] == pytest.approx(-0.5)
    assert rows["reserve (bytes)"][1] == row["reserved"] - row["peak"]
    assert rows["device (bytes)"][1] == row["reserved"] + row["outside"]


# One H100 80GB HBM3, torch 2.11.0+cu130, one process, a GPT of GPT-2 124M's shape (12 x 768, 1024 tokens,
# vocabulary 50304), bf16 autocast: the peak torch.cuda.max_memory_allocated gave for `shoal train` (GiB)
# and the step of the loop a user writes (ms; shoal's own step then was slower, by its host waits)
GPT2 = ["model.n_layer=12", "model.d_model=768", "model.n_head=12", "model.seq_len=1024", "model.vocab_size=50304",
        'data.source="stdlib-text"', 'precision.dtype="bf16"']
PEAKS = {(8, False): 9.21, (16, False): 16.63, (32, False): 31.6, (16, True): 11.4}
LOOP_STEPS = {16: 58.7e-3, 32: 107.1e-3}


@pytest.fixture(scope="module")
def gpt2():
    return Model.build(load_config(None, GPT2), cuda=True)


def _gpt2(model, micro: int, ckpt: bool = False):
    cfg = load_config(None, [*GPT2, f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
                             f"precision.activation_checkpointing={str(ckpt).lower()}"])
    return predict(model, cfg, resolve_layout(cfg, 1, True), H100)


@pytest.mark.parametrize("micro,ckpt", sorted(PEAKS))
def test_the_h100_preset_s_peak_is_within_10_percent_of_the_measured(gpt2, micro, ckpt):
    got = _gpt2(gpt2, micro, ckpt).memory["peak"] / GIB
    assert got == pytest.approx(PEAKS[(micro, ckpt)], rel=0.10), got


@pytest.mark.parametrize("micro", sorted(LOOP_STEPS))
def test_the_h100_preset_s_step_is_within_10_percent_of_the_plain_loop(gpt2, micro):
    got = _gpt2(gpt2, micro).step_time
    assert got == pytest.approx(LOOP_STEPS[micro], rel=0.10), got
    assert not math.isnan(got)


# One H200 (driver 580.159.04, torch 2.11.0+cu130, shoal at 150c39a), the same GPT: `shoal train`'s steps (ms,
# benchmarks/gpu_planner.py) and the plain loop's (benchmarks/gpu_step.py), eager and compiled
H200_SHOAL = {(8, False): 32.22e-3, (16, False): 50.48e-3, (16, True): 42.27e-3}
H200_LOOP = {False: 47.1e-3, True: 34.8e-3}


def _gpt2_on(model, profile, micro: int, compiled: bool):
    cfg = load_config(None, [*GPT2, f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}",
                             f"train.compile={str(compiled).lower()}"])
    return predict(model, cfg, resolve_layout(cfg, 1, True), profile.model_copy(update={"nproc": 1})).step_time


@pytest.mark.parametrize("micro,compiled", sorted(H200_SHOAL))
def test_the_profile_an_h200_measured_on_the_spot_predicts_its_steps_within_10_percent(gpt2, micro, compiled):
    """What `shoal plan` measured on the spot there (tests/fixtures/gpu) against the runs it then timed. Its
    per-operator rates, timed one call at a time, once put these steps at twice what they took."""
    spot = HardwareProfile.model_validate_json((FIXTURES / "gpu" / "h200_spot_profile.json").read_text())
    assert spot.device_name == "NVIDIA H200" and spot.model_extra["host_op_s"] > 2e-5
    got = _gpt2_on(gpt2, spot, micro, compiled)
    assert got == pytest.approx(H200_SHOAL[(micro, compiled)], rel=0.10), got


@pytest.mark.parametrize("compiled", [False, True])
def test_the_h200_preset_s_step_is_within_10_percent_of_the_plain_loop(gpt2, compiled):
    got = _gpt2_on(gpt2, preset("h200"), 16, compiled)
    assert got == pytest.approx(H200_LOOP[compiled], rel=0.10), got


def test_a_cpu_prediction_is_the_fp32_trace_s():
    """On CPU nothing of this applies: the fp32 trace, the largest tensor's gradient as the working term, no
    device terms (the probe measured the resident memory against those)."""
    cfg = load_config(None, TINY)
    profile = HardwareProfile(matmul_flops={"fp32": 1e10, "bf16": 1e10}, memory_bandwidth=1e10)
    model = Model.build(cfg)
    pred = predict(model, cfg, resolve_layout(cfg, 1, False), profile)
    assert "device" not in pred.memory and pred.memory["working"] == model.cost(B).largest
    assert list(model.costs) == [(B, None)]


def test_a_gpu_probe_s_peaks_and_host_time_price_the_kernels():
    """A probe's profile of a GPU: each kernel by kind and size from its measured peak and bandwidth (taken
    whole: already what kernels reach), issued at the host's measured time per operator; its per-operator
    rates, timed one call at a time with a wait on the device, price nothing (they would give a short
    kernel its latency); compiled, the host's time is a launch's."""
    from shoal.plan.cost import Ops
    from shoal.plan.predict import op_time

    measured = H100.model_copy(update={"op_rates_by_dtype": {"bf16": {"add": [[1e6, 1e9], [1e9, 1e9]]}},
                                       "matmul_curve": {"bf16": [[8192.0, 7e14]]}, "memory_bandwidth": 3e12,
                                       "host_op_s": 2e-5, "op_overhead_s": 5e-6})
    ops = Ops([("add", 0.0, 1e8), ("mul", 0.0, 1e8), ("add", 0.0, 10.0)])
    one = 1e8 / 3e12
    assert op_time(ops, measured, "bf16") == pytest.approx(2e-5 + 2 * one + 10.0 / 3e12)  # ran behind the host
    slow = measured.model_copy(update={"host_op_s": 1e-4})
    assert op_time(ops, slow, "bf16") == pytest.approx(3e-4 + 10.0 / 3e12)  # each waits for its launch
    assert op_time(ops, slow, "bf16", compiled=True) == pytest.approx(5e-6 + 2 * one + 10.0 / 3e12)


def test_compile_fuses_a_run_of_memory_bound_operators_into_one_kernel():
    """Between two products: one kernel that reads what enters the run (the first product's output, a bias)
    and writes what leaves it (a tensor saved for backward, the input of the next product); the run's other
    operators have no kernel. A run stops at the forward's end."""
    from shoal.plan.fusion import FUSED, Flow, fused_bytes

    flow = Flow()
    ops = [(("mm", 1.0), [(0, 40), (1, 40)], [(2, 100)]), (("add", 0.0), [(2, 100), (3, 10)], [(4, 100)]),
           (("gelu", 0.0), [(4, 100)], [(5, 100)]), (("mul", 0.0), [(5, 100)], [(6, 100)]),
           (("mm", 1.0), [(6, 100), (1, 40)], [(7, 100)]), (("sum", 0.0), [(7, 100)], [(8, 4)]),
           (("neg", 0.0), [(8, 4)], [(9, 4)])]
    flow.ops = [(ins, outs) for _, ins, outs in ops]
    flow.kept = {4}
    flow.barriers = {6}  # the forward ends after the sum
    items = [(name, flops, float(sum(b for _, b in ins) + sum(b for _, b in outs))) for (name, flops), ins, outs in ops]
    got = fused_bytes(items, flow)
    assert got[1:4] == [100 + 10 + 100 + 100, FUSED, FUSED]  # reads 2 and 3; writes 4 (kept) and 6 (used after)
    assert got[0] == items[0][2] and got[4] == items[4][2]  # the products as they are
    assert got[5] == 100 + 4 and got[6] == 4  # the neg runs after the forward's end: its input leaves the sum's run


def test_a_compiled_gpu_step_moves_fewer_bytes_in_fewer_kernels(gpt2):
    """GPT-2 124M at mb 16 under train.compile: the same products and attention, the memory-bound operators
    fused; a CPU prediction does not change with it (CPU compile is not priced)."""
    cost = gpt2.cost(16, torch.bfloat16)
    kernels = sum(1 for f in cost.ops.fused if f != -1.0)
    assert kernels < 0.5 * len(cost.ops.items)
    bound = [i for i, (_, flops, _) in enumerate(cost.ops.items) if not flops]  # the memory-bound operators
    fused, eager_bytes = (sum(cost.ops.fused[i] for i in bound if cost.ops.fused[i] != -1.0),
                          sum(cost.ops.items[i][2] for i in bound))
    print(f"memory-bound bytes compiled / eager: {fused / eager_bytes:.2f}")
    assert fused < 0.6 * eager_bytes
    eager = _gpt2(gpt2, 16).step_time
    cfg = load_config(None, [*GPT2, "train.micro_batch_size=16", "train.global_batch_size=16", "train.compile=true"])
    compiled = predict(gpt2, cfg, resolve_layout(cfg, 1, True), H100).step_time
    assert 0.6 * eager < compiled < eager


def test_a_gpu_s_measured_fused_adamw_prices_the_optimizer_s_step():
    """The fused AdamW's measured rate (one kernel over every tensor) prices the optimizer's step, in the run's
    dtype's steps; without one, the bandwidth kernels reach."""
    from shoal.plan.cost import Ops
    from shoal.plan.predict import _optimizer_time

    gpu = H100.model_copy(update={"op_rates_by_dtype": {"bf16": {"_fused_adamw_": [[1e8, 1e12]]}}})
    step = Ops(fused_bytes=4e9)
    layout = resolve_layout(load_config(None, TINY), 1, True)
    assert _optimizer_time(step, gpu, "bf16", layout) == pytest.approx(4e9 / 1e12)
    assert _optimizer_time(step, H100, "bf16", layout) == pytest.approx(4e9 / (0.85 * H100.memory_bandwidth))


def test_the_machine_s_gpu_is_named_without_initialising_cuda(monkeypatch):
    """A plan that measures a GPU machine on the spot names its GPU through NVML (no CUDA state in the plan's
    own process while its probe measures the device's memory); torch's name only where NVML cannot say."""
    import shoal.hardware as hw

    def initialises(_index=0):
        raise AssertionError("torch.cuda.get_device_name initialises CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", initialises)
    monkeypatch.setattr(hw, "gpu_memory", lambda: [("NVIDIA H100 80GB HBM3", 85 * 10 ** 9)])
    assert hw.this_machine()["gpu"] == "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(hw, "gpu_memory", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _index=0: "NVIDIA H100 80GB HBM3")
    assert hw.this_machine()["gpu"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.slow  # three plans: ~8 s
def test_on_several_nodes_hsdp_is_planned_with_its_links_priced_apart():
    """Two nodes of 8 H100s: each ZeRO 2/3 layout also as HSDP (a replica a node), holding twice plain
    ZeRO's shard of the state; its gathers priced on NVLink inside a node and its all-reduce across the nodes,
    so on a slower network between nodes HSDP's communication costs less than ZeRO over all 16 ranks'."""
    cfg = load_config(None, ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=256",
                             "train.global_batch_size=64", 'precision.dtype="bf16"'])

    def planned(net):
        profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 2, "network": net})
        return {p.candidate.label(): p for p in plan(cfg, 16, profile, None, cuda=True)}

    fast, slow = planned("nvlink4-ndr400"), planned("nvlink4-eth100")
    plain, hsdp = fast["dp16 tp1 pp1 zero3 mb4"], fast["dp16 tp1 pp1 zero3 hsdp2 mb4"]
    assert plain.ok and hsdp.ok
    assert hsdp.prediction.memory["params"] == pytest.approx(2 * plain.prediction.memory["params"], rel=0.02)
    one_node = plan(cfg, 8, preset("h100").model_copy(update={"nproc": 8}), None, cuda=True)
    assert not any("hsdp" in p.candidate.label() for p in one_node)  # a replica a node: on one node, none
    slow_plain, slow_hsdp = slow["dp16 tp1 pp1 zero3 mb4"], slow["dp16 tp1 pp1 zero3 hsdp2 mb4"]
    assert slow_hsdp.prediction.time["comm"] < slow_plain.prediction.time["comm"]
    # the network between nodes is what moved: inside a node both priced the same
    assert slow_plain.prediction.time["comm"] > plain.prediction.time["comm"]

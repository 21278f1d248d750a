"""shoal plan and shoal probe: the layouts enumerated and why each invalid one is rejected, per-rank
model-state bytes equal to the known counts, --apply's config, --check on a finished run, a probe's
profile, and one-line errors. Pure Python on the meta device (probe: one in-process measurement)."""

import json

import pytest
import tomli_w

from harness import train as train_on_ranks
from shoal.cli import main
from shoal.config import load_config
from shoal.errors import UserError
from shoal.hardware import HardwareProfile, load_profile, this_machine
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.plan.check import check_run
from shoal.plan.planner import parse_bytes, plan
from shoal.plan.report import apply

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.global_batch_size=8", "train.micro_batch_size=2"]
# a profile with curves of the right shape: 10 GFLOP/s, 10 GB/s, 100 us + 1 ns per byte collectives
PROFILE = HardwareProfile(matmul_flops={"fp32": 1e10, "bf16": 1e10}, memory_bandwidth=1e10, op_overhead_s=5e-6,
                          collectives={op: [(4096.0, 1e-4 + 4096e-9), (2 ** 26, 1e-4 + 2 ** 26 * 1e-9)]
                                       for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = load_config(None, TINY)
    path = tmp_path_factory.mktemp("plan") / "tiny.toml"
    raw = {}
    for item in TINY:
        key, value = item.split("=")
        raw.setdefault(key.split(".")[0], {})[key.split(".")[1]] = int(value)
    path.write_text(tomli_w.dumps(raw))
    with on_meta():
        n = sum(p.numel() for p in build_model(cfg.model, _spec(cfg)).model.parameters())
    return cfg, path, n, plan(cfg, 2, PROFILE, parse_bytes("1MiB"))


def _spec(cfg):
    from shoal.data.sources import build_source

    return build_source(cfg.data, cfg.model.seq_len, 0).spec


def by_label(planned):
    return {p.candidate.label(): p for p in planned}


def test_enumerates_layouts_and_names_why_each_invalid_one_fails(tiny):
    _, _, _, planned = tiny
    got = by_label(planned)
    assert {"dp2 tp1 pp1 zero0 mb2", "dp2 tp1 pp1 zero3 ckpt mb4", "dp1 tp2 pp1 zero0 mb1",
            "dp1 tp1 pp2 gpipe zero0 mb2", "dp1 tp1 pp2 interleaved-1f1b zero0 mb2"} <= set(got)
    assert "shards state across the dp ranks, but dp = 1" in got["dp1 tp2 pp1 zero3 mb2"].reason
    assert 'needs at least parallel.pp (2) micro-batches' in got["dp1 tp1 pp2 1f1b zero0 mb8"].reason
    fits = [p for p in planned if p.ok]
    assert fits and all(p.prediction.memory["peak"] <= parse_bytes("1MiB") for p in fits)
    assert any(p.reason and p.reason.startswith("does not fit") for p in planned)
    steps = [p.prediction.step_time for p in fits]
    assert steps == sorted(steps)  # ranked fastest first


def test_model_state_bytes_are_the_known_counts(tiny):
    _, _, n, planned = tiny
    got = by_label(planned)
    zero0, zero3 = got["dp2 tp1 pp1 zero0 mb2"].prediction.memory, got["dp2 tp1 pp1 zero3 mb2"].prediction.memory
    n_tensors = 2 + 2 * 16 + 2  # embeddings, 16 tensors per block, final norm (head tied)
    assert zero0["params"] == zero0["grads"] == 4 * n
    assert zero0["optimizer"] == 2 * 4 * n + 4 * n_tensors  # two fp32 moments + a step per tensor
    assert abs(zero3["params"] - 4 * n / 2) / (4 * n / 2) < 0.01  # sharded by dp (rank 0's chunks round up)
    assert abs(zero3["optimizer"] - (8 * n / 2 + 4 * n_tensors)) / (8 * n / 2) < 0.01


def test_measured_costs_enter_the_prediction(tiny):
    """The probe's per-call costs of FSDP2, a tp layer and DDP, its freshly-mapped-memory cost and heap
    growth each change the prediction by what their formulas say."""
    from shoal.layout import resolve_layout
    from shoal.plan.planner import Model, predict

    cfg, _, _, _ = tiny
    model = Model.build(cfg)

    def prediction(profile, *keys):
        c = load_config(None, [*TINY, *keys])
        return predict(model, c, resolve_layout(c, 2, False), profile)

    calls = {"fsdp_call_s": 1e-3, "fsdp_byte_s": 0.0, "tp_layer_s": 2e-3, "ddp_sync_s": 3e-3, "ddp_local_s": 0.0,
             "ddp_param_s": 0.0}
    measured = PROFILE.model_copy(update={"parallel_overheads": calls})
    # ZeRO 3, 2 blocks, 2 micro-batches of 2 per rank: 2 x 2 x 2 - 2 = 6 block gathers, 4 root gathers,
    # 3 reduce-scatters: 13 calls (the curves' collectives give way to the measured cost)
    z3 = prediction(measured, "parallel.zero=3").time["comm"]
    assert z3 == pytest.approx(13e-3, rel=0.05)
    # tp 2 (dp 1: 4 micro-batches): 6 split matrices per block x 2 blocks + the 2 embeddings, each
    tp = prediction(measured, "parallel.tp=2").time["comm"] - prediction(PROFILE, "parallel.tp=2").time["comm"]
    assert tp > 0.9 * 4 * 14 * 2e-3
    ddp = prediction(measured).time["comm"] - prediction(PROFILE).time["comm"]
    assert ddp == pytest.approx(3e-3 - PROFILE.collective_time("all_reduce", 1152), rel=1e-6)
    fresh = PROFILE.model_copy(update={"fresh_memory_s_per_byte": 1e-9})
    assert prediction(fresh, "parallel.zero=2").step_time > prediction(PROFILE, "parallel.zero=2").step_time
    assert prediction(fresh).time == prediction(PROFILE).time  # ZeRO 0 keeps glibc's own threshold
    base = prediction(PROFILE).memory
    heap = prediction(PROFILE.model_copy(update={"heap_fixed_bytes": 2 ** 20, "heap_ratio": 2.0})).memory
    tensors = sum(base[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "working"))
    assert heap["peak"] - base["peak"] == pytest.approx(2 ** 20 + tensors, abs=2)


def test_costs_kept_across_layouts_change_no_prediction(tiny):
    """A plan keeps what many layouts share (each pipeline split's stage parameters, the operators' time per
    tensor-parallel share, whether the model fits a split): every layout's prediction equals one made from
    a model built for it alone, and every refusal the one checked alone."""
    from shoal.plan.enumerate import candidates, check
    from shoal.plan.planner import Model, predict

    cfg, _, _, planned = tiny
    model = Model.build(cfg)
    checked = [p for p in planned if p.prediction is not None and p.prediction.step_time is not None]
    assert {p.candidate.layout.dims.pp for p in checked} == {1, 2} and {p.candidate.layout.dims.tp for p in checked} == {1, 2}
    for p in checked:
        alone = predict(Model.build(p.candidate.cfg), p.candidate.cfg, p.candidate.layout, PROFILE)
        assert (alone.memory, alone.time) == (p.prediction.memory, p.prediction.time), p.candidate.label()
    # and every refusal is the one a layout gets alone (on 4 workers, pp 4 of the 4 layers: interleaved's
    # 8 stages are refused where 1f1b's 4 are not)
    listed = candidates(cfg, 4, model.bundle, model.source, False, micro_batches=[1])
    assert {c.reason is None for c in listed if c.keys["parallel.pp"] == 4} == {True, False}
    for c in listed:
        assert check(cfg, c.keys, 4, model.bundle, model.source, False).reason == c.reason, c.label()
    pp2 = next(p.candidate.cfg for p in checked if p.candidate.layout.dims.pp == 2)
    shared = Model.build(cfg)
    assert shared.stage_params(pp2, 0) != shared.stage_params(pp2, 1) == Model.build(cfg).stage_params(pp2, 1)


def test_a_micro_batch_s_costs_from_three_traced_sizes_equal_its_own_trace(tiny):
    """After three sizes are traced, a plan takes the others from them (every figure affine in the size):
    exactly what tracing that size gives, the thresholded sums (freshly mapped bytes, the largest tensor)
    included. A figure that is not affine in the three makes it trace every size."""
    import dataclasses

    from shoal.plan.cost import affine
    from shoal.plan.planner import Model

    cfg = tiny[0]
    model = Model.build(cfg)
    for m in (2, 1, 4):
        model.cost(m)
    for m in (3, 8, 16):
        got, want = model.cost(m), Model.build(cfg).cost(m)  # interpolated; traced alone
        assert got == want, m
    assert model.at[None] and len(model.traced[None]) == 3
    straight = model.at[None](32)
    traced = model.traced[None]
    bent = dataclasses.replace(straight, saved_outside=straight.saved_outside + 1)
    assert affine([*traced[:2], straight]) is not None and affine([*traced[:2], bent]) is None


def test_calibration_corrects_the_step_of_its_strategy(tiny):
    """The probe's calibration (plan/calibrate.py): a line through the reference runs' (predicted,
    measured) points, applied to the layouts of its strategy and only to them."""
    from shoal.layout import resolve_layout
    from shoal.plan.calibrate import fit
    from shoal.plan.planner import Model, predict
    from shoal.plan.predict import strategy

    a, b = fit([(0.010, 0.020), (0.100, 0.130)])
    assert a * 0.010 + b == pytest.approx(0.020) and a * 0.100 + b == pytest.approx(0.130)
    assert fit([(0.05, 0.06), (0.05, 0.07)]) == (pytest.approx(1.4), 0.0)
    assert fit([(0.010, 0.020), (0.100, 0.010)]) is None  # a noisy run would turn the line over
    assert fit([(0.1278, 0.0884), (0.1736, 0.2325)]) is None  # 3.15 x - 314 ms: a tp line measured once
    assert fit([(0.100, 0.080), (0.200, 0.500)]) is None  # a slope above 2.5
    assert fit([(0.0233, 0.0291), (0.2159, 0.2381)]) == (pytest.approx(1.085, abs=1e-3), pytest.approx(0.0038, abs=1e-4))

    cfg, _, _, _ = tiny
    model = Model.build(cfg)

    def time(profile, *keys):
        c = load_config(None, [*TINY, *keys])
        layout = resolve_layout(c, 2, False)
        return strategy(layout), predict(model, c, layout, profile).time

    calibrated = PROFILE.model_copy(update={"calibration": {"zero2": (1.5, 0.004), "tp": (0.1, 0.0)}})
    assert time(PROFILE, "parallel.zero=2")[0] == "zero2"
    raw, cal = time(PROFILE, "parallel.zero=2")[1], time(calibrated, "parallel.zero=2")[1]
    assert cal["step"] == pytest.approx(1.5 * raw["step"] + 0.004)
    assert cal["compute"] + cal["comm"] + cal["bubble"] + cal["calibration"] == pytest.approx(cal["step"])
    assert time(calibrated)[1] == time(PROFILE)[1]  # dp: not calibrated, the formulas alone
    assert time(calibrated, "parallel.tp=2")[1]["step"] == pytest.approx(0.5 * time(PROFILE, "parallel.tp=2")[1]["step"])
    assert [time(PROFILE, *k)[0] for k in (["parallel.pp=2"], ["parallel.tp=2", "parallel.zero=0"], [])] == [
        "pp", "tp", "dp"]


def test_apply_writes_a_config_that_loads(tiny, tmp_path):
    cfg, path, _, planned = tiny
    best = apply(path, planned, tmp_path / "best.toml")
    loaded = load_config(tmp_path / "best.toml")
    assert loaded.parallel.zero == best.candidate.keys["parallel.zero"]
    assert loaded.train.micro_batch_size == best.candidate.keys["train.micro_batch_size"]
    assert loaded.model.d_model == 32


def test_check_compares_a_finished_run(tmp_path, ranks):
    run_dir = tmp_path / "run"
    ranks(1).run(train_on_ranks, [*TINY, "train.steps=3", "train.val_interval=0", "train.val_batches=1",
                                  "metrics.tensorboard=false", "metrics.progress=false", "metrics.log_interval=1",
                                  "checkpoint.enabled=false", "checkpoint.final_weights=false"], str(run_dir))
    rows = {name: (pred, meas, err) for name, pred, meas, err in check_run(run_dir, PROFILE)}
    for kind in ("params (bytes)", "grads (bytes)", "optimizer (bytes)"):
        assert rows[kind][2] == 0.0, (kind, rows[kind])  # model state: exact
    assert rows["step time (s)"][1] == json.loads((run_dir / "summary.json").read_text())["median_step_time_s"]


@pytest.mark.slow  # measures the machine for many seconds
def test_probe_writes_a_profile(tmp_path):
    from shoal import dist
    from shoal.hardware import save_profile
    from shoal.plan.probe import measure

    env = dist.init("gloo", 60)
    try:
        profile = measure(env, sizes=(4096,), repeats=1, matmul_sizes=(32,), copy_bytes=2 ** 20, widths=(32, 64))
    finally:
        dist.shutdown()
    save_profile(profile, tmp_path / "p.json")
    got = load_profile(tmp_path / "p.json")
    assert got == profile  # every field, and every figure the probe added, back as measured
    assert got.matmul_flops["fp32"] > 0 and got.matmul_flops["bf16"] > 0 and got.memory_bandwidth > 0
    assert got.machine == this_machine() and got.measured_at > 0 and not got.spot  # where and when, for the cache
    assert set(got.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}  # no pair in a group of 1
    assert got.collective_time("all_reduce", 4096) > 0
    # the reference step's operators: element-wise ones rated by size, matmuls left to the curve
    assert got.op_rate("gelu_backward", 1e5) > 0 and "mm" not in got.op_rates and got.op_overhead_s > 0
    assert got.fresh_memory_s_per_byte is not None and got.heap_ratio > 0 and got.heap_fixed_bytes >= 0
    over = got.parallel_overheads  # one process: no DDP; DTensor, a tp layer and FSDP2 still measured
    assert {"dtensor_op_s", "tp_layer_s", "fsdp_call_s", "fsdp_byte_s"} <= set(over) and "ddp_sync_s" not in over


@pytest.mark.parametrize("argv, message", [
    (["plan", "--hardware", "nope.json"], "hardware profile 'nope.json' does not exist"),
    (["plan", "--preset", "tpu9"], "unknown hardware preset 'tpu9'"),
    (["plan", "--memory", "lots"], "--memory 'lots': expected a size"),
])
def test_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10 ** 9 and parse_bytes("1GiB") == 2 ** 30
    with pytest.raises(UserError):
        parse_bytes("80 parsecs")


def test_activations_are_what_autograd_saves_not_the_weights_and_one_block_recomputes(tiny):
    """A linear layer saves its weight transposed, a view of the parameter: not an activation (a 1T GPT's
    MLP weight, 10 GB, was once counted in every block). Under checkpointing a pipeline keeps each
    micro-batch's block inputs, and one block's saved tensors come back for the one micro-batch whose
    backward runs."""
    from shoal.plan.planner import Model

    cfg = tiny[0]
    cost = Model.build(cfg).cost(2)
    d, s, b = 32, 32, 2
    weights = {n * 4 for n in (d * 3 * d, d * d, d * 4 * d)}  # qkv, proj, mlp matrices in fp32
    assert not weights & set(cost.saved)
    # a block's saved activations are a few dozen (b, s, d) tensors, where its weights alone are 12 d^2
    assert cost.saved_per_block[0] < 40 * b * s * d * 4
    inputs, one = cost.block_input[0], max(cost.saved_per_block)
    full = cost.activation_bytes(True, 1.0, in_flight=4)
    assert full == int(4 * (cost.saved_outside + 2 * inputs) + one)
    assert cost.activation_bytes(False, 1.0, in_flight=4) == 4 * cost.activation_bytes(False, 1.0)


def test_materialised_attention_saves_its_scores_and_costs_their_passes(tiny):
    """Attention as stacks before flash attention ran it (fused_attention=False): each head's s x s scores,
    their softmax saved and their dropout's mask, several memory-bound passes over them."""
    from shoal.plan.planner import Model

    cfg = tiny[0]
    fused, unfused = Model.build(cfg).cost(2), Model.build(cfg, False, 0.1).cost(2)
    h, s, b = 2, 32, 2
    scores = h * s * s * b * 4  # one fp32 copy of a layer's scores
    extra = unfused.saved_per_block[0] - fused.saved_per_block[0]
    assert 2 * scores <= extra <= 4 * scores  # the softmax's output and the dropout's mask, at least
    names = [n for n, *_ in unfused.ops.items]
    assert "_softmax" in names and "bernoulli_" in names  # on a CPU dropout multiplies by a noise tensor
    assert not any("flash" in n for n in names) and any("flash" in n for n, *_ in fused.ops.items)
    # the same products either way: torch counts a fused kernel's QK^T and PV in full, causal or not
    # (compat.flop_formula: the CPU kernel the trace takes, counted as 2.15 counts it on every release)
    attention = 2 * 2 * b * s * s * 32  # QK^T and PV of a layer (d = 32), full
    assert [f for n, f, _ in fused.ops.items if "flash" in n and "backward" not in n] == [attention] * 2
    assert unfused.forward_flops == fused.forward_flops
    no_dropout = Model.build(cfg, False, 0.0).cost(2)
    assert "bernoulli_" not in [n for n, *_ in no_dropout.ops.items]

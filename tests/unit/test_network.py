"""A preset's network (plan/network.py): NCCL's own cost model with nccl-tests' bus bandwidths, each group
priced by its size and how many of its ranks share a node; every layout of a preset plan gets a step
time and is ranked by it; bad input is one line."""

import math

import pytest

from shoal.cli import main
from shoal.config import load_config
from shoal.hardware import CLUSTERS, preset
from shoal.layout import resolve_layout
from shoal.plan.network import NETWORKS, NIC_FRACTION
from shoal.plan.planner import Model, plan, predict
from shoal.plan.predict import DDP_BUCKET_BYTES, ModelShape, _ddp_comm, _fsdp_comm, group_of

H100 = NETWORKS["nvlink4-ndr400"]
GIB = 2 ** 30


def test_a_large_all_reduce_moves_at_the_bus_bandwidth_of_where_its_group_is():
    """nccl-tests' convention: an all-reduce of S bytes over n ranks moves S x 2(n-1)/n at the bus bandwidth;
    NCCL's ring (Simple) adds 8.4 us and 3.4 us per step in a node, 9.6 us per step across nodes."""
    def ring(nbytes, n, nodes, busbw):
        steps, cross = 2 * (n - 1), 2 * (nodes - 1)
        return (8.4 + (steps - cross) * 3.4 + cross * 9.6) * 1e-6 + nbytes * steps / n / busbw

    assert H100.seconds("all_reduce", GIB, 8, 8) == pytest.approx(ring(GIB, 8, 1, 460e9))
    assert H100.seconds("all_reduce", GIB, 32, 8) == pytest.approx(ring(GIB, 32, 4, 400e9))  # 4 whole nodes
    assert H100.seconds("all_reduce", GIB, 32, 1) == pytest.approx(ring(GIB, 32, 32, 40e9))  # tp 8 in each node
    half = H100.bus_bandwidth(4, 2)  # 4 of the group's ranks per node: the line between the two ends
    assert half == pytest.approx(40e9 + (400e9 - 40e9) * 3 / 7)
    assert H100.seconds("all_gather", GIB, 8, 8) == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + GIB * 7 / 8 / 460e9)


def test_a_small_message_takes_the_latency_of_nccl_s_fastest_algorithm():
    # 8 bytes on 8 ranks in a node: ring LL, 3.6 us + 14 steps x 0.47 us (tree LL: 4.4 + 2 x 7 x 0.52)
    assert H100.seconds("all_reduce", 8, 8, 8) == pytest.approx((3.6 + 14 * 0.47) * 1e-6, rel=0.02)
    # across 128 nodes the tree's log2 wins over the ring's 254 network steps
    ring = (3.6 + (2 * 1023 - 2 * 127) * 0.47 + 2 * 127 * 2.7) * 1e-6
    assert H100.seconds("all_reduce", 8, 1024, 8) < ring / 5
    assert H100.seconds("send_recv", 8, 2, 1) > H100.seconds("send_recv", 8, 2, 2)  # a hop across nodes


@pytest.mark.parametrize("sets, world, expected", [
    (["parallel.tp=8"], 32, {"tp": (8, 8), "dp": (4, 1), "pp": (2, 1)}),  # tp in a node, dp across
    (["parallel.tp=2"], 32, {"tp": (2, 2), "dp": (16, 4), "pp": (2, 1)}),
    (["parallel.tp=16"], 32, {"tp": (16, 8), "dp": (2, 1), "pp": (2, 1)}),  # tp spills over a node
    (["parallel.pp=2", "parallel.tp=2"], 8, {"tp": (2, 2), "dp": (2, 2), "pp": (2, 2)}),  # one node
])
def test_groups_are_placed_tp_innermost(sets, world, expected):
    cfg = load_config(None, [*sets, "train.global_batch_size=64", "train.micro_batch_size=1"])
    layout = resolve_layout(cfg, world, True)
    assert {axis: group_of(layout, 8, axis) for axis in ("tp", "dp", "pp")} == expected


def test_every_layout_of_a_preset_plan_has_a_step_time_and_is_ranked_by_it():
    cfg = load_config(None, ["model.n_layer=4", "model.d_model=256", "model.n_head=8", "model.seq_len=256",
                             "train.global_batch_size=64", 'precision.dtype="bf16"'])
    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 2})
    valid = [p for p in plan(cfg, 16, profile, None, cuda=True, micro_batches=[1, 4]) if p.ok]
    steps = [p.prediction.step_time for p in valid]
    assert valid and None not in steps and steps == sorted(steps)
    comm = {p.candidate.label(): p.prediction.time["comm"] for p in valid}
    # the same dp 16 x ZeRO 0 on A100s' HDR network communicates more slowly
    a100_net = profile.model_copy(update={"network": "nvlink3-hdr200"})
    slower = {p.candidate.label(): p.prediction.time["comm"] for p in plan(cfg, 16, a100_net, None, cuda=True,
                                                                           micro_batches=[4]) if p.ok}
    assert slower["dp16 tp1 pp1 zero0 mb4"] > comm["dp16 tp1 pp1 zero0 mb4"] > 0


@pytest.mark.parametrize("argv, message", [
    (["plan", "--preset", "h100", "--network", "tofu-d"], "unknown network 'tofu-d'; use one of nvlink4-ndr400, "),
    (["plan", "--preset", "h100-tofu"], "unknown hardware preset 'h100-tofu'; use one of h100, h200, a100, h100-ib400,"),
    (["plan", "--network", "nvlink4-ndr400"], "--network nvlink4-ndr400: a network prices a preset's collectives"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_named_presets_carry_their_network_and_a_network_built_from_links_is_its_nics_at_the_measured_fraction():
    assert {name: preset(name).network for name in CLUSTERS} == {name: net for name, (_, net) in CLUSTERS.items()}
    assert preset("a100-efa400").matmul_flops == preset("a100").matmul_flops
    efa = NETWORKS["nvlink3-efa400"]  # 4 x 100 Gb/s a node: 12.5 GB/s a NIC at NDR's measured 0.8
    assert (efa.across, efa.one_per_node) == pytest.approx((4 * 12.5e9 * NIC_FRACTION, 12.5e9 * NIC_FRACTION))


def test_any_preset_takes_any_network(capsys):
    assert main(["plan", "--preset", "a100-ib200", "--network", "nvlink3-efa400", "--nproc", "8", "--nnodes", "2",
                 "--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=2",
                 "--set", "model.seq_len=32", "--set", "train.global_batch_size=16", "--top", "1"]) == 0
    assert "ms" in capsys.readouterr().out


GPT = ["model.n_layer=4", "model.d_model=256", "model.n_head=8", "model.seq_len=256", "train.global_batch_size=64",
       'precision.dtype="bf16"', "train.micro_batch_size=2"]


def _predicted(sets, world=8, nodes=1):
    cfg = load_config(None, [*GPT, *sets])
    profile = preset("h100").model_copy(update={"nproc": world // nodes, "nnodes": nodes})
    return predict(Model.build(cfg), cfg, resolve_layout(cfg, world, True), profile).time


@pytest.mark.parametrize("schedule, idle_micro_batches", [("gpipe", 3), ("1f1b", 3), ("interleaved-1f1b", 1.5)])
def test_a_pipeline_idles_p_minus_1_over_v_micro_batches_of_its_stage(schedule, idle_micro_batches):
    """pp 4: GPipe and 1F1B idle (p - 1) = 3 micro-batches' forward and backward of a stage, interleaved
    1F1B with v = 2 stages a rank (p - 1) / v = 1.5 (Narayanan et al. 2021, section 2.2), whatever the
    number of micro-batches. A stage's micro-batch is what 32 more micro-batches add to the compute."""
    sets = ["model.n_layer=8", "parallel.pp=4", f'parallel.pp_schedule="{schedule}"', "parallel.pp_stages_per_rank=2"]
    t32 = _predicted(sets, 4)  # 64 sequences in micro-batches of 2
    t64 = _predicted([*sets, "train.global_batch_size=128"], 4)
    per_micro = (t64["compute"] - t32["compute"]) / 32
    assert t32["bubble"] == pytest.approx(idle_micro_batches * per_micro, rel=1e-9)
    assert t64["bubble"] == pytest.approx(t32["bubble"], rel=1e-9)
    assert t32["step"] == pytest.approx(t32["compute"] + t32["bubble"] + t32["comm"])


class Net:
    """A profile on one network, its group of dp ranks all in one node."""

    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
    net = NETWORKS["nvlink4-ndr400"]


def _shape(n_params: int, n_blocks: int = 4) -> ModelShape:
    block = [(n_params // n_blocks, 1024, 2, True)]
    return ModelShape([block[0]] * n_blocks, [block] * n_blocks)


def _dp8(zero: int):
    cfg = load_config(None, [*GPT, f"parallel.zero={zero}"])
    return resolve_layout(cfg, 8, True)


def test_ddp_hides_every_bucket_under_backward_but_the_last():
    """4 buckets of 25 MiB on 8 GPUs of a node: with a long backward only the last bucket's all-reduce is
    left, with none all four; plus one pass over the gradients (DDP's division by the world size)."""
    grad = 4 * DDP_BUCKET_BYTES
    each = Net.net.seconds("all_reduce", DDP_BUCKET_BYTES, 8, 8)
    div = 2 * grad / Net.profile.memory_bandwidth
    layout = _dp8(0)
    assert _ddp_comm(_shape(grad // 4), Net.profile, layout, 1, grad, backward=1.0) == pytest.approx(each + div)
    assert _ddp_comm(_shape(grad // 4), Net.profile, layout, 1, grad, backward=0.0) == pytest.approx(4 * each + div)
    partly = _ddp_comm(_shape(grad // 4), Net.profile, layout, 1, grad, backward=1.5 * each)
    assert partly == pytest.approx(each + 1.5 * each + div)  # 3 buckets' worth beside 1.5 of backward


def test_zero1_s_gather_after_the_step_is_not_hidden():
    """ZeroRedundancyOptimizer broadcasts each parameter from its owner after the step, when there is no
    backward left to hide it under: the same seconds whatever the backward."""
    grad, shape = 4 * DDP_BUCKET_BYTES, _shape(DDP_BUCKET_BYTES)
    extra = [_ddp_comm(shape, Net.profile, _dp8(1), 1, grad, backward=b) - _ddp_comm(shape, Net.profile, _dp8(0), 1,
                                                                                     grad, backward=b)
             for b in (0.0, 10.0)]
    one = Net.net.seconds("send_recv", DDP_BUCKET_BYTES, 8, 8)  # each of 4 fp32 tensors of 25 MiB
    assert extra == pytest.approx([4 * one, 4 * one])


def test_zero3_prefetches_every_gather_but_the_first():
    """ZeRO 3 (FSDP2) on 4 blocks, 1 micro-batch: 4 gathers in forward, 3 again in backward (the last
    block's stays), 4 reduce-scatters; with a block's compute longer than any of them only the first
    gather and the first reduce-scatter are exposed, with none every one."""
    shape = _shape(4 * 2 ** 24)
    block = 2 ** 24 * 4  # bytes of a block's parameters
    gather = Net.net.seconds("all_gather", block, 8, 8)  # ct keys an all-gather by its shard: x 8 = the block
    scatter = Net.net.seconds("reduce_scatter", block, 8, 8)
    layout = _dp8(3)
    hidden, _ = _fsdp_comm(shape, Net.profile, layout, 1, 4 * block, per_micro=100.0, optimizer_ops=0)
    exposed, _ = _fsdp_comm(shape, Net.profile, layout, 1, 4 * block, per_micro=0.0, optimizer_ops=0)
    assert hidden == pytest.approx(gather + scatter)
    assert exposed == pytest.approx(7 * gather + 4 * scatter)
    assert math.isfinite(exposed)

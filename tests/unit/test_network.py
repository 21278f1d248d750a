"""A preset's network (plan/network.py): NCCL's own cost model with nccl-tests' bus bandwidths, each group
priced by its size and how many of its ranks share a node; every layout of a preset plan gets a step
time and is ranked by it; bad input is one line."""

import pytest

from shoal.cli import main
from shoal.config import load_config
from shoal.hardware import preset
from shoal.layout import resolve_layout
from shoal.plan.network import NETWORKS
from shoal.plan.planner import plan
from shoal.plan.predict import group_of

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
    (["plan", "--network", "nvlink4-ndr400"], "--network nvlink4-ndr400: a network prices a preset's collectives"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1

"""The step profile's arithmetic: the parts of a step add up to it, MFU from a known FLOP count and
peak, the pipeline bubble, naming a straggler."""

import pytest

from shoal.metrics.profile import Profiler, bubble_fraction, mfu, name_straggler, step_breakdown


def test_mfu_from_known_flops_and_peak():
    # 6e12 FLOPs per step over 2 workers in 3 s: 1e12 FLOP/s each, a quarter of a 4e12 peak
    assert mfu(6e12, 3.0, 2, 4e12) == {"flops_per_s": pytest.approx(1e12), "mfu": pytest.approx(0.25)}


def test_parts_add_up_to_the_step():
    phases = {"data_wait_s": 0.01, "forward_backward_s": 0.30, "optimizer_s": 0.05}
    exposed = {"forward_backward_s": {"dp": 0.04, "world": 0.01}, "optimizer_s": {"world": 0.02, "pp": 0.005}}
    m = step_breakdown(phases, exposed, ("dp", "pp"), bubble_fraction(2, 4))
    assert m["time_bubble_s"] == pytest.approx(0.25 * 0.2)  # (2-1)/(4+2-1) of the 0.25 s not waiting
    assert m["time_compute_s"] == pytest.approx(0.25 * 0.8)
    assert m["time_exposed_dp_s"] == pytest.approx(0.04) and m["time_exposed_world_s"] == pytest.approx(0.03)
    assert m["time_exposed_pp_s"] == pytest.approx(0.005) and m["time_optimizer_s"] == pytest.approx(0.025)
    assert "time_exposed_tp_s" not in m  # an axis the layout does not have and that never waited
    assert sum(m.values()) == pytest.approx(sum(phases.values()))


def test_bubble_of_the_schedules():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)  # interleaving shrinks it


def test_straggler_named_against_the_other_ranks():
    assert name_straggler([1.0, 1.8, 1.0, 1.1], 1.2) == (1, pytest.approx(1.8))
    assert name_straggler([1.0, 1.1], 1.2) is None  # within the ratio: nobody
    assert name_straggler([2.0], 1.2) is None
    p = Profiler(("dp",), 0.0, 2, 1e9, 1e10, 1.5, logged_step=10)
    assert p.stragglers([0.1, 0.2], 20) == {"compute_s_per_rank": [0.1, 0.2], "straggler_rank": 1,
                                            "straggler_ratio": pytest.approx(2.0), "straggler_steps": [11, 20]}


def test_compute_is_compared_per_even_share_of_the_batch():
    """Under balance.mode a rank given twice the samples computes twice as long without being slow."""
    phases = {"forward_backward_s": 0.2, "optimizer_s": 0.0}
    fast_with_more = Profiler(("dp",), 0.0, 2, None, None, 1.2)
    fast_with_more.step(phases, {}, 0.2, share=4 / 3)  # 8 of 12 samples: an even share is 6
    slow_with_less = Profiler(("dp",), 0.0, 2, None, None, 1.2)
    slow_with_less.step(phases, {}, 0.2, share=2 / 3)  # 4 of 12, as long: twice as slow per sample
    compute = [fast_with_more.take_compute(), slow_with_less.take_compute()]
    assert compute == [pytest.approx(0.15), pytest.approx(0.3)]
    assert fast_with_more.stragglers(compute, 1)["straggler_rank"] == 1

"""The planner's calibration runs (plan/calibrate.py): the probe's reference GPT trained by `shoal train`
on 2 processes at two widths, twice each, each point's measured median steps paired with the formulas'
prediction for it, and the line through the points' medians."""

import json
import statistics

from shoal.hardware import HardwareProfile
from shoal.plan.calibrate import fit, reference_points

PROFILE = HardwareProfile(matmul_flops={"fp32": 1e10, "bf16": 1e10}, memory_bandwidth=1e10, op_overhead_s=5e-6,
                          collectives={op: [(4096.0, 1e-4 + 4096e-9), (2 ** 26, 1e-4 + 2 ** 26 * 1e-9)]
                                       for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")},
                          calibration={"dp": (9.0, 1.0)})  # ignored: the points are the formulas'


def test_reference_runs_pair_prediction_and_measurement(tmp_path):
    """Two rounds of the two points: each point's runs in their own run dirs (STRATEGY-WIDTH-RUN/ATTEMPT),
    its measured steps those runs' medians, in round order."""
    points = reference_points(PROFILE, 2, 1, (32, 128), tmp_path, strategies=["dp"], timeout=180, repeats=2)
    assert list(points) == ["dp"]
    (p0, m0), (p1, m1) = points["dp"]
    for width, measured in ((32, m0), (128, m1)):
        assert len(measured) == 2
        for run, step in enumerate(measured):
            run_dir = tmp_path / f"dp-{width}-{run}" / "0"
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["world_size"] == 2 and summary["median_step_time_s"] == step
            assert f"d_model = {width}" in (run_dir / "config.toml").read_text()
    assert 0 < p0 < p1 < 1.0  # the formulas' own step, not the profile's calibration of dp (x 9 + 1 s)
    line = fit(points["dp"])  # the line through both points' medians, or None where noise made it unphysical
    mid0, mid1 = statistics.median(m0), statistics.median(m1)
    assert line is None or abs(line[0] * p0 + line[1] - mid0) < 1e-9 and abs(line[0] * p1 + line[1] - mid1) < 1e-9

"""benchmarks/gpu_planner.py: `plan --check`'s rows read back whatever their names, the median and worst error per
profile and quantity, the RESULT line, the runs a device takes; and the script itself on the CPU (slow: one run)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_shares import in_share

from benchmarks import gpu_planner
from benchmarks import gpu_planner_report as report

ROOT = Path(__file__).resolve().parents[2]

# as `shoal plan --check` prints them (cli/plan.py), a row it may add included
CHECK = """profile: preset h100 (NVIDIA H100 SXM (data sheet); network nvlink4-ndr400)
step time (s)          predicted      0.03195  measured      0.04314  error -25.9%
params (bytes)         predicted   474.70 MiB  measured   474.70 MiB  error +0.0%
activations (bytes)    predicted     4.02 GiB  measured            ?  error ?
peak (bytes)           predicted     5.90 GiB  measured     9.21 GiB  error -36.0%
context + nccl (bytes) predicted   512.00 MiB  measured   530.10 MiB  error -3.4%
reserve (bytes)        predicted          0 B  measured            ?  error ?
"""


def test_every_row_is_read_as_printed_whatever_its_name():
    rows = report.check_rows(CHECK)
    assert [r["name"] for r in rows] == ["step time (s)", "params (bytes)", "activations (bytes)", "peak (bytes)",
                                         "context + nccl (bytes)", "reserve (bytes)"]
    assert rows[0] == {"name": "step time (s)", "predicted": "0.03195", "measured": "0.04314", "error": -0.259}
    assert rows[2]["measured"] == "?" and rows[2]["error"] is None
    assert rows[3]["predicted"] == "5.90 GiB" and rows[3]["error"] == pytest.approx(-0.36)
    assert rows[5]["predicted"] == "0 B"
    line = report.table_lines("mb8", "preset h100", rows[:1])[0]
    assert line.split() == ["mb8", "preset", "h100", "step", "time", "(s)", "0.03195", "0.04314", "-25.9%"]


def check(run: str, profile: str, step: float | None, peak: float) -> dict:
    return {"run": run, "profile": profile, "rows": [{"name": "step time (s)", "error": step},
                                                     {"name": "peak (bytes)", "error": peak},
                                                     {"name": "params (bytes)", "error": 0.0}]}


def test_the_median_and_worst_error_per_profile_and_the_result_line():
    results = [check("mb8", "preset h100", -0.259, -0.36), check("mb8", "spot", 0.02, 0.05),
               check("mb16", "preset h100", -0.359, -0.416), check("mb16", "spot", -0.08, 0.04),
               check("mb16-ckpt", "preset h100", 0.10, 0.30), check("mb16-ckpt", "spot", None, -0.01)]
    spreads = report.summary(results)
    preset, spot = spreads["preset h100"], spreads["spot"]
    assert preset["step time (s)"] == {"median": pytest.approx(0.259), "worst": -0.359, "worst_run": "mb16", "runs": 3}
    assert spot["step time (s)"]["runs"] == 2 and spot["step time (s)"]["median"] == pytest.approx(0.05)
    assert preset["peak (bytes)"]["worst"] == -0.416 and spot["peak (bytes)"]["worst_run"] == "mb8"
    fields = report.result_fields(spreads)
    assert fields == {"preset_step_time_median": "0.259", "preset_step_time_worst": "-0.359",
                      "preset_peak_median": "0.360", "preset_peak_worst": "-0.416",
                      "spot_step_time_median": "0.050", "spot_step_time_worst": "-0.080",
                      "spot_peak_median": "0.040", "spot_peak_worst": "+0.050"}
    lines = report.summary_lines(spreads)
    assert lines[1].split()[-3:] == ["25.9%", "-35.9%", "(mb16)"] and len(lines) == 1 + 2 * 3
    assert report.result_line({"card": '"cpu"'}, {"failed": "0"}) == 'RESULT card="cpu" failed=0'


def test_a_gpu_trains_fp16_beside_the_variants_of_its_larger_micro_batch_and_a_cpu_does_not():
    gpu, cpu = gpu_planner.runs([8, 16], cuda=True), gpu_planner.runs([2, 4], cuda=False)
    assert list(gpu) == ["mb8", "mb16", "mb16-ckpt", "mb16-compile", "mb16-chunks", "mb16-fp16"]
    assert list(cpu) == ["mb2", "mb4", "mb4-ckpt", "mb4-compile", "mb4-chunks"]
    assert gpu["mb16-ckpt"] == ["train.micro_batch_size=16", "train.global_batch_size=16",
                                "precision.activation_checkpointing=true"]


@pytest.mark.slow  # the script's CPU mode on one run: the plan's measurement, a training, two checks (~30 s)
@pytest.mark.benchmark  # its reduced form, in its share of make test-benchmarks
@in_share("gpu_planner")
def test_the_script_plans_trains_and_checks_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_planner", "--runs", "mb2", "--steps", "4",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "no CUDA GPU: ran on CPU with a tiny model" in r.stdout
    assert any(ln.startswith("the first plan: ") and "measured on the spot in " in ln for ln in lines)
    result = dict(kv.split("=", 1) for kv in shlex.split(lines[-1])[1:])  # card="CPU (AMD EPYC)"
    assert lines[-1].startswith("RESULT ") and result["failed"] == "0" and result["runs"] == "1"
    assert {"preset_step_time_median", "spot_step_time_median", "spot_peak_worst"} <= set(result)
    saved = json.loads((tmp_path / "gpu_planner.json").read_text())
    profiles = [c["profile"] for c in saved["checks"]]
    assert profiles == ["preset h100", "spot"]
    spot = saved["checks"][1]
    assert "measured on the spot by shoal plan" in spot["line"]  # the cached spot profile, not none
    assert {"step time (s)", "peak (bytes)"} <= {row["name"] for row in spot["rows"]}

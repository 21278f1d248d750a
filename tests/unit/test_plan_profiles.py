"""Which profile `shoal plan` uses when given none (plan/profiles.py): this machine's cached one, a cached
one from another machine or torch refused in one line, --hardware forcing one, and the table's title
and missing-times line (plan/report.py). The measurement on the spot itself runs for real in the
README's tour (tests/integration/test_docs_commands.py); here it is replaced where a test must not
measure."""

from __future__ import annotations

import pytest
from rich.console import Console

from shoal.cli import main
from shoal.config import load_config
from shoal.hardware import HardwareProfile, save_profile, this_machine
from shoal.plan import profiles
from shoal.plan.planner import Planned, plan, ranking

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.global_batch_size=8", "train.micro_batch_size=2"]
CURVES = {op: [(4096.0, 1e-4 + 4096e-9), (2 ** 26, 1e-4 + 2 ** 26 * 1e-9)]
          for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")}


def profile_of(machine: dict, **kw) -> HardwareProfile:
    return HardwareProfile(matmul_flops={"fp32": 1e10, "bf16": 1e10}, memory_bandwidth=1e10, op_overhead_s=5e-6,
                           collectives=CURVES, nproc=2, machine=machine, measured_at=1.0, device_name="a test CPU",
                           **kw)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def never(nproc):
        raise AssertionError("measured on the spot where a profile was cached")
    monkeypatch.setattr(profiles, "spot", never)
    return tmp_path / "cache" / "shoal" / "profiles"


def plan_argv(*extra) -> list[str]:
    return ["plan", "--nproc", "2", *[a for k in TINY for a in ("--set", k)], *extra]


def test_the_cached_profile_of_this_machine_is_used_and_named(cache, capsys):
    stored = profiles.store(profile_of(this_machine(), calibration={"dp": (1.0, 0.0)}))
    assert stored == profiles.cache_path(this_machine(), 2, 1) and stored.is_relative_to(cache)
    assert main(plan_argv()) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith(f"profile: {stored}, measured by shoal probe ") and "calibrated for dp" in first, first
    assert "valid layouts, fastest first" in out


def test_a_cached_profile_of_another_machine_or_torch_is_refused_in_one_line(cache, monkeypatch, capsys):
    elsewhere = {**this_machine(), "torch": "2.12.0", "cores": 96}
    profiles.store(profile_of(elsewhere))
    chosen = profiles.choose(2, 1, measure=False)
    assert chosen.profile is None
    here = this_machine()
    assert f"the cached one was measured with cores 96 (here {here['cores']}), torch 2.12.0 (here {here['torch']}): " \
           "not used" in chosen.line and "\n" not in chosen.line, chosen.line
    # with measuring allowed: measured on the spot instead, the refusal said on the same line
    measured = profile_of(here, spot=True)
    monkeypatch.setattr(profiles, "spot", lambda nproc: measured)
    assert main(plan_argv()) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("profile: measured on the spot in ") and "torch 2.12.0 (here" in first, first
    # ... and cached under this machine: the next plan uses it
    assert profiles.choose(2, 1, measure=False).profile == measured


def test_hardware_forces_a_profile_of_another_machine_and_says_so(cache, tmp_path, capsys):
    path = tmp_path / "theirs.json"
    save_profile(profile_of({**this_machine(), "cpu": "a 1990s CPU"}), path)
    assert main(plan_argv("--hardware", str(path))) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"profile: {path}, ") and "measured on another machine: cpu a 1990s CPU (here " in first \
        and "used as --hardware asks" in first, first


def test_without_step_times_the_table_is_not_fastest_first_and_says_what_is_missing(cache):
    cfg = load_config(None, TINY)
    console = Console(record=True, width=250)
    untimed = plan(cfg, 2, None, None)
    from shoal.plan.report import render

    render(untimed, 5, console, missing="run `shoal probe --nproc 2`")
    text = console.export_text()
    assert "fastest first" not in text and "valid layouts by peak memory per rank, no step times" in text
    n = sum(p.ok for p in untimed)
    assert f"{n} of {n} layouts without a step time: no step times (no hardware profile); run `shoal probe " \
           "--nproc 2`" in text
    # a profile without collective curves: compute alone is predicted, and the order says so
    console = Console(record=True, width=250)
    render(plan(cfg, 2, profile_of(this_machine()).model_copy(update={"collectives": {}}), None), 5, console)
    text = console.export_text()
    assert "by predicted compute time, then peak memory" in text and "communication is not predicted" in text


def test_a_layout_without_a_step_time_never_ranks_above_one_with():
    from shoal.plan.enumerate import Candidate
    from shoal.plan.predict import Prediction

    def planned(name, step, compute, peak):
        return Planned(Candidate({"name": name}), Prediction({"peak": peak}, {"step": step, "compute": compute}))
    mixed = [planned("untimed, least compute", None, 0.001, 1), planned("slow", 0.5, 0.4, 9),
             planned("untimed", None, 0.002, 1), planned("fast", 0.1, 0.1, 9), planned("no compute", None, None, 0)]
    assert [p.candidate.keys["name"] for p in sorted(mixed, key=ranking)] == \
        ["fast", "slow", "untimed, least compute", "untimed", "no compute"]


def test_a_rate_measured_on_scalars_only_is_not_the_operator_s_speed():
    """A probe's reference GPT multiplies only scalars: that rate is the call's cost. Asked about megabytes, the
    operator moves at the copy bandwidth, not at the scalars' rate; one measured on real data stays flat beyond
    its largest size, as before."""
    p = HardwareProfile(matmul_flops={"fp32": 1e10}, memory_bandwidth=1e10,
                        op_rates={"mul": [(8.0, 1e6)], "add": [(8.0, 1e6), (1e6, 5e9)]})
    assert p.op_rate("mul", 8.0) == 1e6
    assert p.op_rate("mul", 3e6) == 1e10
    assert p.op_rate("add", 3e6) == pytest.approx(5e9)

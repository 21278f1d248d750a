"""benchmarks/published_runs.py: its table of published runs is well-formed and cited, the script runs on
two rows in seconds, and its figures are the planner's own (a changed row changes them)."""

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from benchmark_shares import in_share

from shoal.layout import resolve_layout
from shoal.plan.planner import Model, predict

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
pr = sys.modules["published_runs"] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
spec.loader.exec_module(pr)

SMALL = ("korthikanti-22B", "megatron-1.7B")  # 8 and 32 GPUs: a few seconds of planning each


@pytest.fixture(scope="module")
def planned_22b():
    """The 22B row planned once for the tests that read it (~3 s a plan)."""
    return pr.plan_row(next(r for r in pr.ROWS if r.name == "korthikanti-22B"))


def test_the_table_is_well_formed_and_every_row_cited():
    rows = pr.ROWS
    assert len(rows) >= 12 and len({r.name for r in rows}) == len(rows)
    assert len({r.source.split(",")[0] for r in rows}) >= 3  # Narayanan, Korthikanti, BigScience
    for r in rows:
        assert re.search(r"Table \d|Important checkpoints|iteration times", r.source), r.name
        assert r.dp * r.tp * r.pp == r.gpus and r.dp >= 1, r.name
        assert r.batch % (r.dp * r.micro) == 0 and r.hidden % r.heads == 0, r.name
        assert r.layers % (r.pp * r.v) == 0 or r.v == 1, r.name
        assert r.unit in ("tflops", "s") and r.reported > 0 and r.recompute in ("full", "none")
        pr.config_for(r)  # a config shoal loads
    # the source's own FLOP formula: Table 1's 1T row, 163 TFLOP/s on 3072 GPUs, 502 petaFLOP/s aggregate
    one_t = next(r for r in rows if r.name == "megatron-1T")
    assert one_t.reported_tflops() * one_t.gpus / 1e3 == pytest.approx(502, rel=0.01)


@pytest.mark.slow  # the benchmark script end to end (~15 s)
@pytest.mark.benchmark  # its reduced form, in its share of make test-benchmarks
@in_share("published_runs")
def test_the_script_runs_on_two_rows_and_ends_with_its_result_line(capsys):
    assert pr.main(["--rows", ",".join(SMALL)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("RESULT published_median_err=") and "rows=2/2" in lines[-1]
    assert sum(1 for line in lines if line.split()[0] in SMALL) == 2


def test_predictions_are_the_planner_s_and_move_with_the_row(planned_22b):
    """Each row's prediction is what the planner gives for that row's config on that row's cluster: the same
    as a plan of its own, and another GPU (H100's peak) or another network changes it."""
    row, planned = planned_22b.row, planned_22b
    cfg = pr.config_for(row)
    model = Model.build(cfg, row.fused_attention, row.attention_dropout, row.hidden_dropout, cuda=True)
    alone = predict(model, cfg, resolve_layout(cfg, row.gpus, True), pr.profile_for(row)).time
    assert planned.own == pytest.approx(alone)
    h100 = dataclasses.replace(row, preset="h100", network="nvlink4-ndr400")
    faster = predict(model, cfg, resolve_layout(cfg, row.gpus, True), pr.profile_for(h100)).time
    assert faster["compute"] < 0.5 * planned.own["compute"]  # 989 against 312 TFLOP/s, 3.35 against 2.04 TB/s
    # the leave-one-out factor is the others' median: with two rows, each takes the other's
    other_row = next(r for r in pr.ROWS if r.name == "megatron-1.7B")
    other = pr.Planned(other_row, {**planned.own, "compute": 3 * planned.own["compute"]}, None, planned.others, 0.0)
    scored = {s["row"].name: s for s in pr.score([planned, other])}
    assert scored["korthikanti-22B"]["eff"] == pytest.approx(pr.implied_efficiency(other))
    assert scored["megatron-1.7B"]["eff"] == pytest.approx(pr.implied_efficiency(planned))


def test_a_profile_s_compute_efficiency_divides_its_compute():
    row = next(r for r in pr.ROWS if r.name == "megatron-1.7B")  # the smallest row: the quickest trace
    cfg, profile = pr.config_for(row), pr.profile_for(row)
    layout = resolve_layout(cfg, row.gpus, True)
    model = Model.build(cfg)  # its traces are kept per profile, so one build serves both
    full = predict(model, cfg, layout, profile).time
    half = predict(model, cfg, layout, profile.model_copy(update={"compute_efficiency": 0.5})).time
    assert half["compute"] == pytest.approx(2 * full["compute"])
    assert half["step"] == pytest.approx(half["compute"] + half["bubble"] + half["comm"])


@pytest.mark.slow  # two of the rows' whole checks (the fast tier plans rows in the tests above)
def test_every_row_s_own_layout_passes_the_run_s_checks_on_its_80_gib_gpu():
    """The rows' GPUs are 80 GiB A100s, and their token stream holds enough validation windows for dp =
    2,240 (the default source's 195 made a run's start refuse the ZeRO-3 rows)."""
    from shoal.plan.enumerate import check

    assert all(r.memory == 80 * 2 ** 30 for r in pr.ROWS)
    for name in ("zero3-530B-2240", "megatron-1.7B"):
        row = next(r for r in pr.ROWS if r.name == name)
        cfg = pr.config_for(row)
        model = Model.build(cfg)
        keys = {**pr.own_keys(row), "parallel.pp_schedule": cfg.parallel.pp_schedule, "parallel.pp_microbatches": 0}
        assert check(cfg, keys, row.gpus, model.bundle, model.source, True).reason is None, name


def test_a_cached_plan_is_the_plan(tmp_path, monkeypatch, planned_22b):
    monkeypatch.setattr(pr.tempfile, "gettempdir", lambda: str(tmp_path))
    row = planned_22b.row
    key = pr._cache_key(row)  # of the real planning code (the stand-ins below have other sources)
    monkeypatch.setattr(pr, "_cache_key", lambda r: key)
    monkeypatch.setattr(pr, "_plan_row", lambda r: planned_22b)  # what planning gives, without planning again
    first = pr.plan_row(row, cache=True)
    monkeypatch.setattr(pr, "_plan_row", lambda r: pytest.fail("planned again where the cache holds the plan"))
    again = pr.plan_row(row, cache=True)
    assert again.cached and not first.cached
    assert (again.own, again.others, again.own_reason) == (first.own, first.others, first.own_reason)
    assert len(list(tmp_path.glob("shoal-published-runs/korthikanti-22B-*.json"))) == 1

"""What `shoal report` reads from a run dir: every phase key present (not a fixed list), the time of a
checkpoint in the attempt that saved it, named stragglers, and one-line errors for what is not a run."""

import re
import sys

import pytest

from conftest import FIXTURES
from shoal.errors import UserError, install_hint
from shoal.report.data import (
    comm_keys,
    load_run,
    load_runs,
    per_rank_keys,
    phase_keys,
    run_phases,
    series,
    step_time_at,
    stragglers,
    throughput_keys,
)

sys.path.insert(0, str(FIXTURES))
from report_runs import write_runs  # noqa: E402


def test_the_report_finds_what_each_run_recorded(tmp_path):
    done, running = load_runs(write_runs(tmp_path))
    # without the step profile: the timer's phases (the step's total and rates are not phases)
    assert run_phases(running) == ["data_wait_s", "forward_backward_s", "optimizer_s"]
    # with it: its parts, which add up to the step time, and not the timer's phases they re-cut
    parts = ["time_data_wait_s", "time_compute_s", "time_bubble_s", "time_optimizer_s", "time_exposed_dp_s"]
    assert run_phases(done) == parts
    assert sum(done.rows[0][k] for k in parts) == pytest.approx(done.rows[0]["step_time_s"])
    assert phase_keys([running, done]) == run_phases(running) + parts
    # any other per-step *_s key a layout records is a phase too
    running.rows[0]["pipeline_wait_s"] = 0.001
    assert run_phases(running)[-1] == "pipeline_wait_s"
    assert throughput_keys([done]) == ["tokens_per_s"]
    assert comm_keys([done]) == ["comm_bytes", "comm_bytes_dp"]
    assert per_rank_keys([done, running]) == ["compute_s_per_rank"]
    assert stragglers(done) == [
        "rank 1: named at 1 logged step(s), compute at worst 1.80x the median of the other ranks",
        "steps 16-20: rank 1, compute up to 1.80x the median of the other ranks"]
    assert stragglers(running) == []
    # validation is on some rows only; the running run's partial last line is left out
    assert series(done, "val_loss") == ([10, 20], [4.6, 4.1])
    assert series(running, "loss")[0] == [2, 4, 6, 8, 10, 12, 14]
    assert running.summary == {} and done.recoveries[0]["failed_after_step"] == 12


def test_a_step_is_placed_in_the_last_attempt_that_reached_it(tmp_path):
    done, running = load_runs(write_runs(tmp_path))
    rows_11 = [r["time"] - done.t0 for r in done.rows if r["step"] == 11]
    assert len(rows_11) == 2 and step_time_at(done, 11) == pytest.approx(rows_11[1])  # after the recovery
    # between two logged steps: interpolated; before the first logged step: unknown
    assert step_time_at(running, 3) == pytest.approx(0.06)
    assert step_time_at(running, 1) is None


def test_what_is_not_a_run_is_one_line(tmp_path):
    with pytest.raises(UserError, match="is not a run dir"):
        load_run(tmp_path)
    (tmp_path / "config.toml").write_text("")
    with pytest.raises(UserError, match="no metrics yet"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no metrics yet"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "ti\n{"step": 2, "time": 1.0}\n')
    with pytest.raises(UserError, match="line 1 is not JSON"):
        load_run(tmp_path)


def test_without_matplotlib_the_report_names_its_extra(tmp_path, monkeypatch):
    from shoal.report.page import render

    done, _ = write_runs(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(UserError, match=re.escape(install_hint("report"))):
        render([done], tmp_path / "report.html")


def test_the_page_goes_into_the_run_dir_of_one_run_and_here_for_several(tmp_path, monkeypatch, capsys):
    from shoal.cli import main

    done, running = write_runs(tmp_path / "runs")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["report", str(done)]) == 0
    assert (done / "report.html").is_file() and (done / "report-loss.png").is_file()
    assert f"wrote {done / 'report.html'}" in capsys.readouterr().out
    assert list(here.iterdir()) == []  # nothing left in the current directory
    assert main(["report", str(done), str(running)]) == 0
    out = capsys.readouterr().out
    assert (here / "report.html").is_file() and "several runs: the page goes to the current directory" in out
    assert main(["report", str(done), "--out", str(tmp_path / "x" / "page.html")]) == 0  # --out still wins
    assert (tmp_path / "x" / "page.html").is_file()

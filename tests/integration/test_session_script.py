"""A user's own loop over shoal.Session (tests/fixtures/session_script.py), run as a script under `shoal run`:
killed with SIGKILL mid-run and run again, it ends bitwise equal to a run never interrupted; `shoal plan
--check` and `shoal report` read its run dir."""

import json

import pytest
from safetensors.torch import load_file

from conftest import FIXTURES, run_cli
from shoal.cli import main

pytestmark = pytest.mark.slow  # runs the CLI

SCRIPT = FIXTURES / "session_script.py"


def test_a_killed_script_rerun_ends_as_an_uninterrupted_one(tmp_path, capsys, monkeypatch):
    zero = "3"  # ZeRO 3: the sharded case (plain dp was checked the same way by hand: equal too)
    whole = run_cli(["run", "--nproc", "2", SCRIPT, tmp_path / "whole", zero], timeout=120, cwd=tmp_path)
    assert whole.returncode == 0, whole.output
    killed = run_cli(["run", "--nproc", "2", SCRIPT, tmp_path / "killed", zero], timeout=120, cwd=tmp_path,
                     env={"KILL_AT": "5"})
    assert killed.returncode == 137, killed.output  # rank 0's SIGKILL: 128 + 9
    assert "shoal: rank 0 (pid" in killed.stderr and "failed with signal SIGKILL" in killed.stderr
    again = run_cli(["run", "--nproc", "2", SCRIPT, tmp_path / "killed", zero], timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.output
    assert "starting at step 4" in again.stdout  # the checkpoint of step 4 (checkpoint.interval = 2)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "killed" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bitwise, dropout included
    losses = {json.loads(ln)["step"]: json.loads(ln)["loss"] for ln in (tmp_path / "whole" / "metrics.jsonl")
              .read_text().splitlines() if "loss" in ln}
    redone = [json.loads(ln) for ln in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
              if "loss" in ln]
    # step 5 trained twice, before the kill and again, but its line is written once: a step's report is read
    # once the next step is queued, and the kill came first
    assert [m["step"] for m in redone] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(m["loss"] == losses[m["step"]] for m in redone)
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final_loss"] == losses[8]

    # the run dir is a shoal run dir: the planner predicts its model state, the report draws it (the CLI's
    # commands in this process: what they read is the point, not a process of their own)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no profile of this machine: none cached
    assert main(["plan", "--check", str(tmp_path / "whole")]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("  ")[0].strip(): ln for ln in out.splitlines() if "predicted" in ln}
    for row in ("params (bytes)", "grads (bytes)", "optimizer (bytes)", "model state (bytes)"):
        assert abs(float(rows[row].split("error ")[1].rstrip("%"))) <= 1.0, out
    assert "error ?" in rows["peak (bytes)"] and "a Session's run" in out, out
    assert main(["report", str(tmp_path / "whole"), "--out", str(tmp_path / "report.html")]) == 0
    assert (tmp_path / "report.html").stat().st_size > 10_000

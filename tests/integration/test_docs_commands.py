"""The commands the docs show, run exactly as written (every ```sh block of the README, docs/ and
benchmarks/*.md; tests/unit/test_docs.py checks that every other block is marked as an
illustration or is a file's contents). Each page runs in a scratch directory of its own that holds the
repository's configs/ and tests/ and this interpreter's virtual environment as .venv, so `runs/...`
land there and a page's later blocks see what its earlier ones made.

The README's tour is the newcomer's path, so its results are checked as well: the default job as `make
run` runs it (2 processes, its schedule compressed to 30 steps) learns and writes every result file, the
same command resumes it, `shoal parity` passes one process against ZeRO 3 with a row per step, `shoal
report` writes its page into the run dir, and `shoal plan` with nothing but the config measures the machine
on the spot, ranks every layout by its step time and caches the profile."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, Result, read_metrics, run_cli
from doc_pages import DOCS, code_blocks

# a page's block that repeats one of the README's (docs/planner.md's `shoal plan`) runs in the tour
TOUR = {body for _, info, body in code_blocks(ROOT / "README.md") if info == "sh"}
PAGES = [p for p in DOCS if p.name != "README.md" and any(info == "sh" and body not in TOUR
                                                          for _, info, body in code_blocks(p))]


def scratch(tmp_path: Path) -> Path:
    here = tmp_path / "repo"
    here.mkdir()
    for name in ("configs", "tests"):
        (here / name).symlink_to(ROOT / name)
    (here / ".venv").symlink_to(Path(sys.prefix))  # the interpreter's environment, wherever it is
    (here / "runs").mkdir()
    return here


def run_block(body: str, cwd: Path, where: str, timeout: float = 240) -> Result:
    """One ```sh block through bash, stopping at its first failing command."""
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    if "shoal plan" in body or "shoal probe" in body:  # the page's own profile cache, empty at first, as on a
        env["XDG_CACHE_HOME"] = str(cwd / ".cache")    # new machine (never the user's ~/.cache)
    r = run_cli([body], timeout=timeout, cwd=cwd, env=env, launcher=["bash", "-e", "-o", "pipefail", "-c"])
    assert r.returncode == 0, f"{where}:\n{body}\n{r.output[-3000:]}"
    return r


def sh_blocks(path: Path, but: set[str] = frozenset()) -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)}:{line}", body) for line, info, body in code_blocks(path)
            if info == "sh" and body not in but]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_pages_commands_run_as_written(tmp_path, page):
    here = scratch(tmp_path)
    for where, body in sh_blocks(page, but=TOUR):
        run_block(body, here, where)


def test_the_readme_tour(tmp_path):
    here = scratch(tmp_path)
    blocks = sh_blocks(ROOT / "README.md")
    commands = [next(c for c in ("train", "parity", "report", "plan") if f"shoal {c} " in body) for _, body in blocks]
    assert commands == ["train", "train", "parity", "report", "plan"], commands
    train, resume, parity, report, plan = blocks

    run_block(train[1], here, train[0])
    tour = here / "runs" / "tour"
    summary = json.loads((tour / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["val_loss"] < 3.4, summary  # nats per byte, the schedule compressed to 30 steps: measured 3.16
    # (5.55 untrained; make run's 1,150 steps reach 1.78)
    metrics = read_metrics(tour)
    assert [m["step"] for m in metrics] == list(range(10, 31, 10))
    assert all(m["tokens_per_s"] > 0 and m["data_wait_s"] >= 0 for m in metrics)
    assert (tour / "config.toml").read_text().startswith("[model]")
    assert list((tour / "tensorboard").glob("events.out.tfevents.*"))
    assert (tour / "model.safetensors").stat().st_size > 3_000_000  # 834k fp32 parameters
    assert [p.name for p in (tour / "checkpoints").iterdir()] == ["step_00000030"]

    r = run_block(resume[1], here, resume[0])
    assert "resumed from" in r.stdout and "(step 30)" in r.stdout, r.stdout
    assert "results in runs/tour/" in r.stdout and json.loads((tour / "summary.json").read_text())["steps"] == 40

    r = run_block(parity[1], here, parity[0])
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: largest relative difference: loss") and last.endswith("tolerance 1e-05"), r.stdout
    rows = [line for line in r.stdout.splitlines() if re.match(r"\W*\d+\W+\d+\.\d{6}\W+\d+\.\d{6}", line)]
    assert len(rows) == 6, r.stdout  # a row per step: step, both losses, ...

    run_block(report[1], here, report[0])
    assert (tour / "report.html").is_file() and (tour / "report-loss.png").is_file()

    # nothing but the config: no profile cached, so the machine is measured on the spot (seconds, no
    # calibration), every valid layout gets a step time, and the profile is cached for the next plan
    r = run_block(plan[1], here, plan[0])
    first = r.stdout.splitlines()[0]
    assert first.startswith("profile: measured on the spot in ") and "not calibrated: `shoal probe --nproc 2`" in first
    assert re.search(r"\d+ valid layouts, fastest first", r.stdout) and "rejected layouts" in r.stdout, r.stdout
    top = next(ln for ln in r.stdout.splitlines() if re.match(r"\W+1\W+dp", ln))
    assert re.search(r"\d+\.\d ms", top), top
    assert f"cached in {here / '.cache' / 'shoal' / 'profiles'}" in first, first  # the next plan's (test_plan_profiles)

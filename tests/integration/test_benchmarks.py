"""Every benchmark in its reduced form: the same script and code path as its measured run, on the fewest steps,
repeats and sizes its arguments allow, ending with its `RESULT` line. Its figures mean nothing; what it catches is
a change of shoal (an API, a config key, a model's forward) that leaves a benchmark broken, which before this file
nothing noticed until someone measured (benchmarks/parameter_server.py failed at its first step for days).

Each script of benchmarks/ that runs as `python -m benchmarks.NAME` has a row here (REDUCED), is run in its reduced
form by another test (ELSEWHERE), or is a part another script runs (PARTS); a script in none of them fails
`test_every_benchmark_has_a_reduced_form`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest
from benchmark_shares import SHARES, share

from conftest import ROOT, run_cli

ROOT_ONLY = "needs root: it makes network namespaces and rate limits (shoal cluster)"
# name: (its reduced form's arguments, a reason it cannot run here or None, its timeout in seconds)
REDUCED: dict[str, tuple[list[str], str | None, float]] = {
    "checkpoint_cost": (["--repeats", "1", "--sizes", "default"], None, 240),
    "context_memory": (["--rounds", "1", "--steps", "1", "--seq-len", "256", "--n-layer", "2"], None, 180),
    "default_job": (["--steps", "20"], None, 180),
    "diloco_outer": (["--steps", "16", "--variants", "every-step"], None, 240),
    "dp_overhead": (["--rounds", "1", "--steps", "30", "--micro", "2"], None, 180),
    "elastic": (["--minutes", "0.15", "--baseline-minutes", "0.1", "--every", "4", "--replace-after", "1",
                 "--modes", "restart-30s"], ROOT_ONLY, 240),
    "first_plan": (["--steps", "2", "--repeats", "1", "--layouts", "dp2"], None, 240),
    "gpu_paths": (["--only", "train-fp32,export"], None, 240),
    "gpu_step": (["--quick", "--micro", "2", "--pairs", "1"], None, 300),
    "horovod": (["--rounds", "1", "--steps", "30", "--micro", "2"], None, 180),
    "host_parts": (["--repeats", "1", "--seconds", "2"], None, 180),
    "host_reads": ([], None, 120),
    "host_step": (["--pairs", "3", "--warmup", "10", "--timed", "100"], None, 240),
    "load_balance": (["--slow", "inject", "--steps", "12"], None, 240),
    "memory_sharding": (["--steps", "2", "--n-layer", "2"], None, 240),
    "moe_experts": (["--rounds", "1", "--steps", "6"], None, 240),
    "parameter_server": (["--steps", "13", "--quick"], ROOT_ONLY, 300),
    "planner_accuracy": (["--steps", "3", "--max-size", "1MiB", "--no-calibrate", "--spot", "--layouts", "dp2,pp2-1f1b"],
                         None, 240),
    "profile_overhead": (["--rounds", "1", "--steps", "30"], None, 120),
    "restore": (["--repeats", "1"], None, 120),
    "sharded_start": (["--n-layer", "2", "--d-model", "256"], None, 240),
    "slow_links": (["--steps", "13", "--modes", "none"], ROOT_ONLY, 300),
    "start_init_memory": (["--side", "1024"], None, 120),
    "startup": (["--rounds", "1"], None, 240),
    "step_costs": (["--steps", "4"], None, 120),
    "straggler": (["--runs", "1"], None, 120),
}
# run in their reduced forms by tests of their own (marked benchmark, run in their shares: benchmark_shares.in_share)
ELSEWHERE = {"gpu_planner": "tests/unit/test_gpu_planner.py", "published_runs": "tests/unit/test_published_runs.py"}
# a part of another script, run by it (its reduced form runs this one too)
PARTS = {"deepspeed_worker": "memory_sharding", "gpu_step_loop": "gpu_step", "plain_ddp": "dp_overhead",
         "torchft_ddp": "elastic"}


def scripts() -> set[str]:
    return {p.stem for p in (ROOT / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text()}


@contextlib.contextmanager
def one_at_a_time():
    """The one-machine cluster (shoal cluster) is one per machine: two benchmarks on it at once each take it down
    under the other (seen: parameter_server's run stopped by SIGTERM, slow_links's "no cluster is up"). So a lock on
    a file of the machine's (pytest-xdist's loadgroup would keep them on one worker, but its groups are lost under
    pytest 9: the node id it suffixes is no longer the one scheduled)."""
    with (Path(tempfile.gettempdir()) / "shoal-one-machine-cluster.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def test_every_benchmark_has_a_reduced_form():
    missing = scripts() - set(REDUCED) - set(ELSEWHERE) - set(PARTS)
    assert not missing, f"give {sorted(missing)} a row in REDUCED (tests/integration/test_benchmarks.py)"
    assert set(PARTS.values()) <= set(REDUCED) and not set(REDUCED) & set(ELSEWHERE)
    gone = (set(REDUCED) | set(ELSEWHERE) | set(PARTS)) - scripts()
    assert not gone, f"rows for scripts that are not in benchmarks/: {sorted(gone)}"
    shared = [name for names in SHARES for name in names]
    assert sorted(shared) == sorted([*REDUCED, *ELSEWHERE]), \
        f"put each of REDUCED and ELSEWHERE in one of SHARES (tests/benchmark_shares.py): {sorted(REDUCED)}"
    assert [share(str(k)) for k in range(len(SHARES))] == [sorted(names) for names in SHARES]
    assert share(None) == sorted(shared)
    with pytest.raises(pytest.UsageError, match="SHOAL_BENCHMARK_SHARE=5: give a share from 0 to 4"):
        share("5")


@pytest.mark.slow
@pytest.mark.benchmark  # make test-benchmarks (make test leaves these out)
@pytest.mark.parametrize("name", [n for n in share(os.environ.get("SHOAL_BENCHMARK_SHARE")) if n in REDUCED])
def test_a_benchmark_runs_in_its_reduced_form(name, tmp_path):
    args, cannot, timeout = REDUCED[name]
    if cannot == ROOT_ONLY and os.geteuid() != 0:
        pytest.skip(f"benchmarks/{name}.py {ROOT_ONLY}")
    with one_at_a_time() if cannot == ROOT_ONLY else contextlib.nullcontext():
        # a cache of its own: `shoal probe` keeps what it measured in the user's cache, where `shoal plan` reads it
        r = run_cli(["-m", f"benchmarks.{name}", *args], timeout=timeout, cwd=ROOT,
                    env={"TMPDIR": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}, launcher=[sys.executable])
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert r.returncode == 0 and lines and lines[-1].startswith("RESULT "), (
        f"python -m benchmarks.{name} {' '.join(args)}: exit {r.returncode}\n{r.output[-3000:]}")


def test_the_table_names_real_arguments():
    """Each row's flags are ones its script's parser defines (a typo would make the reduced form exit 2)."""
    for name, (args, _, _) in REDUCED.items():
        text = (ROOT / "benchmarks" / f"{name}.py").read_text()
        unknown = [a for a in args if a.startswith("--") and f'"{a}"' not in text]
        assert not unknown, f"benchmarks/{name}.py has no {unknown}"


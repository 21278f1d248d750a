"""Which benchmarks' reduced forms run where: `make test-benchmarks SHARE=k` runs share k of SHARES (CI runs one share
a landing, chosen by the count of commits, so that landings move through the five: all of them, ~450 s on two
workers, do not fit its 25 minutes beside make test). A name is a script of benchmarks/: its row of
tests/integration/test_benchmarks.py's REDUCED, or a script whose reduced form a test of its own runs (ELSEWHERE
there), marked benchmark and run in its share only. Balanced by hand on the rows' wall times at e7aa685 (~230
test-seconds each; the three on the one-machine cluster, which run one at a time, in three shares)."""

from __future__ import annotations

import os

import pytest

SHARES = (
    ("parameter_server", "checkpoint_cost", "horovod", "straggler", "restore"),
    ("slow_links", "gpu_paths", "memory_sharding", "diloco_outer", "host_parts"),
    ("elastic", "planner_accuracy", "startup", "moe_experts", "profile_overhead", "published_runs"),
    ("first_plan", "gpu_step", "sharded_start", "default_job", "start_init_memory"),
    ("host_reads", "load_balance", "dp_overhead", "step_costs", "host_step", "context_memory", "gpu_planner"),
)


def share(which: str | None) -> list[str]:
    """The names `make test-benchmarks SHARE=k` runs (SHOAL_BENCHMARK_SHARE): share k of SHARES, or every name
    where it is not set. One line naming the fix for a share that is not one."""
    if not which:
        return sorted(name for names in SHARES for name in names)
    if not which.isdigit() or int(which) >= len(SHARES):
        raise pytest.UsageError(f"SHOAL_BENCHMARK_SHARE={which}: give a share from 0 to {len(SHARES) - 1}, or none "
                                f"for every benchmark")
    return sorted(SHARES[int(which)])


def in_share(name: str) -> pytest.MarkDecorator:
    """For a test of its own that runs a script's reduced form: a benchmark (make test leaves it out), skipped
    outside the script's share."""
    return pytest.mark.skipif(name not in share(os.environ.get("SHOAL_BENCHMARK_SHARE")),
                              reason=f"benchmarks/{name}.py runs in another share of make test-benchmarks")

"""`shoal env --check` on this machine, as a user runs it: on a CPU machine, two workers over gloo check
their collectives against known sums and train one step of a tiny GPT (tests/unit/test_env.py simulates
the causes that make it fail)."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_env_check_passes_on_this_machine():
    done = subprocess.run([sys.executable, "-m", "shoal", "env", "--check", "--nproc", "2"], capture_output=True,
                          text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    lines = out.splitlines()
    assert lines[0].startswith("shoal env --check: 2 worker(s)")
    assert re.search(r"^ok    collective  all-reduce and all-gather across 2 worker\(s\) over (gloo|nccl) gave the "
                     r"expected values; a 64 MiB all-reduce at [\d.]+ GB/s bus bandwidth$", out, re.M), out
    assert len([ln for ln in lines if ln.startswith("ok    matmul      rank ")]) == 2
    loss = re.search(r"^ok    training    one step of a tiny GPT on 2 worker\(s\): loss ([\d.]+)", out, re.M)
    assert loss and 4.0 < float(loss.group(1)) < 7.0  # about ln(256): a byte-level model before it learned
    assert not [ln for ln in lines if ln.startswith("FAIL")]

"""The GPU tier: every path of benchmarks/gpu_paths.py (its PATHS table: name, what it needs CUDA for, its check)
run on the GPU, one test each, and the fp32 reference run's losses against the baseline recorded for the card. On a
GPU machine: `make test-gpu`; on one without, each is skipped with its reason, and `make test` leaves the tier out
(tests/conftest.py). The paths that can run on a CPU as well run there in `benchmarks/gpu_paths.py` itself.

A baseline is the reference run's loss at every step on one card (tests/gpu/baselines/<card>.json), written by
`SHOAL_GPU_BASELINE=write make test-gpu` on that card; a later run on the same card must stay within
BASELINE_RTOL of it. The tolerance is a first guess, not yet measured: another torch or driver may choose other
kernels, which sum in another order."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_paths
from benchmarks.gpu_paths_tools import STEPS, check_close, fp32_run

CUDA = torch.cuda.is_available()
BASELINES = Path(__file__).parent / "baselines"
BASELINE_RTOL = 1e-3

pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA GPU here: the GPU tier runs on a GPU machine (make test-gpu)")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """One context for every path of the tier, as benchmarks/gpu_paths.py makes it: the fp32 reference run is
    trained once and read by the paths held to it."""
    out = tmp_path_factory.mktemp("gpu-paths")
    made, _ = gpu_paths.context(out, out / "logs")
    return made


@pytest.mark.parametrize("name", list(gpu_paths.PATHS))
def test_a_path_on_the_gpu(ctx, name):
    status, detail = gpu_paths.run_path(ctx, name)
    assert status == "ok", f"{name}: {detail} (logs in {ctx.logs})"
    print(f"{name}: {detail}")  # what the path measured: `make test-gpu` shows it (-rP)


def card_file() -> Path:
    name = torch.cuda.get_device_name(0)
    return BASELINES / (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".json")


def test_the_reference_run_keeps_to_the_card_s_baseline(ctx):
    losses = fp32_run(ctx).losses
    path = card_file()
    if os.environ.get("SHOAL_GPU_BASELINE") == "write":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                    "losses": {str(k): v for k, v in sorted(losses.items())}}, indent=1) + "\n")
    if not path.exists():
        pytest.skip(f"no baseline for {torch.cuda.get_device_name(0)} yet: SHOAL_GPU_BASELINE=write make test-gpu "
                    f"records one ({path.relative_to(Path(__file__).parents[2])})")
    recorded = {int(k): v for k, v in json.loads(path.read_text())["losses"].items()}
    print(check_close(losses, recorded, range(1, STEPS + 1), BASELINE_RTOL, f"the baseline in {path.name}"))

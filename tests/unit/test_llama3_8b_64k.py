"""configs/llama3-8b-64k.toml, Llama 3 8B on sequences of 65,536 tokens on one node of 8 GPUs, each sequence split
over the 8 by context parallelism: `shoal plan` on the H100 preset says that its own layout fits 80 GB, that
without cp no layout does, and predicts its step; docs/context.md quotes these figures, which this test holds to
the plan. Predictions only: never run on a GPU."""

import importlib.util
from pathlib import Path

import pytest

from shoal.config import load_config
from shoal.hardware import preset
from shoal.plan.planner import parse_bytes, plan

if importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra is not installed", allow_module_level=True)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llama3-8b-64k.toml"
LAYOUT = "dp8 tp1 pp1 cp8 zero3 ckpt mb1"  # the config's own
N_PARAMS = 8_030_261_248


@pytest.mark.slow  # plans the 8B model at 65,536 tokens: ~5 s
def test_plan_on_h100_fits_the_config_only_with_cp_and_the_quoted_figures_are_its():
    cfg = load_config(CONFIG)
    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
    memory = parse_bytes("80GB")
    # one sequence a micro-batch (the config's, and all the figures quoted): a third of the layouts to plan
    planned = {p.candidate.label(): p for p in plan(cfg, 8, profile, memory, micro_batches=[1])}
    own = planned[LAYOUT]
    assert own.ok, own.reason
    gib = 2 ** 30
    # docs/context.md: a step of 35.2 s, 31.8 GiB of tensors a rank, 33.3 GiB on the device; cp 4 (2 groups of 4)
    # 34.8 s in 49.4 GiB
    assert (round(own.prediction.step_time, 1), round(own.prediction.memory["peak"] / gib, 1),
            round(own.prediction.memory["device"] / gib, 1)) == (35.2, 31.8, 33.3)
    cp4 = planned["dp8 tp1 pp1 cp4 zero3 ckpt mb1"]
    assert (round(cp4.prediction.step_time, 1), round(cp4.prediction.memory["device"] / gib, 1)) == (34.8, 49.4)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    assert 6 * N_PARAMS * tokens / (8 * profile.matmul_flops["bf16"]) < own.prediction.step_time
    without = [p for p in planned.values() if p.candidate.keys.get("parallel.cp", 1) == 1]
    assert without and not any(p.ok for p in without), [p.candidate.label() for p in without if p.ok]

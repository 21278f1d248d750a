"""configs/moe-16b.toml, a DeepSeek-V3-style mixture of experts for one node of 8 GPUs: at full size it builds on
the meta device at the hand count below (15.6B parameters, 2.5B active per token), passes the checks a launch on 8
H100s runs, and `shoal plan` on the H100 preset puts its own layout first, fitting 80 GB; the figures its comments
and docs/moe.md quote are the plan's. At reduced size, its command trains with expert parallelism under ZeRO 3 and
prints only shoal's lines."""

from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from shoal import hardware
from shoal.config import load_config
from shoal.hardware import preset
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.plan.planner import parse_bytes, plan
from shoal.preflight import check_job

CONFIG = ROOT / "configs" / "moe-16b.toml"
LAYOUT = "dp8 tp1 pp1 zero3 mb1"  # the config's own, on 8 GPUs
# By hand: d 2,048, vocabulary 102,400 (the embedding tied to the head), 4,096 learned positions, 27 blocks (each
# q, k, v, o with biases and two LayerNorms), the first with a dense MLP of 4 d (biases), the other 26 with a
# router (64 x d), 64 SwiGLU experts of 1,408 (3 matrices each) and 2 shared ones as one SwiGLU of 2,816
D, V, T, E, H, K, LAYERS = 2048, 102_400, 4096, 64, 1408, 6, 27
ATTENTION = 4 * D * D + 4 * D + 4 * D
DENSE = 2 * 4 * D * D + 4 * D + D
MOE = E * D + 3 * E * D * H + 3 * 2 * H * D
TOTAL = V * D + T * D + LAYERS * ATTENTION + DENSE + (LAYERS - 1) * MOE + 2 * D
ACTIVE = TOTAL - (LAYERS - 1) * (E - K) * 3 * D * H


def test_full_size_builds_on_meta_at_its_count():
    assert (TOTAL, ACTIVE) == (15_553_198_080, 2_507_864_064)
    with on_meta():
        bundle = build_model(load_config(CONFIG).model, DataSpec(kind="tokens", vocab_size=256))
    assert sum(p.numel() for p in bundle.model.parameters()) == TOTAL and bundle.active_params == ACTIVE


@pytest.mark.slow  # the 15.6B model's meta build and the standard library's bytes
def test_full_size_passes_the_preflight_on_8_h100s(monkeypatch):
    cfg = load_config(CONFIG)
    monkeypatch.setattr(hardware, "gpu_memory", lambda: [("NVIDIA H100 80GB HBM3", 81_559 * 2 ** 20)] * 8)
    job = check_job(cfg, [8], cuda=True, quiet=True, local_workers=8)
    layout = job.layouts[0]
    assert job.n_params == TOTAL and (layout.dims.dp, layout.zero, layout.grad_accum) == (8, 3, 2)


@pytest.mark.slow  # ~740 layouts of the 15.6B model: ~9 s
def test_plan_on_h100_puts_the_config_first_and_the_quoted_figures_are_its():
    """As `shoal plan configs/moe-16b.toml --nproc 8 --preset h100 --memory 80GB` plans it: the config's layout
    is the fastest that fits, the step no shorter than the data sheet allows (6 x the active parameters' FLOPs a
    token at the H100's bf16 peak), and the config's comments and docs/moe.md quote its figures."""
    cfg = load_config(CONFIG)
    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
    ranked = [p for p in plan(cfg, 8, profile, parse_bytes("80GB")) if p.ok]
    own, recomputed = ranked[0], next(p for p in ranked if p.candidate.label() == "dp8 tp1 pp1 zero3 ckpt mb2")
    assert own.candidate.label() == LAYOUT
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    assert 6 * ACTIVE * tokens / (8 * profile.matmul_flops["bf16"]) < own.prediction.step_time < 3.0
    text = " ".join(CONFIG.read_text().replace("#", " ").split())
    docs = " ".join((ROOT / "docs" / "moe.md").read_text().split())

    def figures(p) -> list[str]:
        return [f"{p.prediction.time['step'] * 1000:.1f} ms", f"{p.prediction.memory['peak'] / 2 ** 30:.1f} GiB"]

    quoted = [f"a step of {figures(own)[0]}", f"{figures(own)[1]} of tensors a rank",
              f"{own.prediction.fit_bytes / 2 ** 30:.1f} GiB on the device",
              f"{figures(recomputed)[0]} in {recomputed.prediction.fit_bytes / 2 ** 30:.1f} GiB"]
    for q in quoted:
        assert q in text, q
        assert q in docs, q
    ep = {e: next(p for p in ranked if p.candidate.label() == f"dp8 tp1 pp1 ep{e} zero3 mb1") for e in (2, 4, 8)}
    assert f"the plan puts it at {figures(ep[8])[0]}" in text
    assert (f"ep 2, 4 and 8 under ZeRO 3 after plain ZeRO 3 ({figures(ep[2])[0][:-3]}, {figures(ep[4])[0][:-3]} and "
            f"{figures(ep[8])[0]} against {figures(own)[0][:-3]})") in docs


@pytest.mark.slow  # a CLI run on 2 workers
def test_the_reduced_size_command_trains_with_expert_parallelism_and_prints_only_shoals_lines(tmp_path):
    lines = CONFIG.read_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if "shoal train configs/moe-16b.toml --nproc 2" in ln)
    parts = [lines[i].lstrip("#").strip()]
    while parts[-1].endswith("\\"):  # continued on the next comment line
        i += 1
        parts.append(lines[i].lstrip("#").strip())
    command = " ".join(part.rstrip("\\") for part in parts)
    args = command.split()[1:]  # after `shoal`
    r = run_cli([*args, "--run-dir", str(tmp_path / "run")], timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.output
    assert "parallel.ep=2" in command and not [ln for ln in r.stderr.splitlines() if "torch" in ln], r.stderr
    assert Path(tmp_path / "run" / "summary.json").exists()

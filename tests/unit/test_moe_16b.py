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


# torchtitan's DeepSeek-V3 16B on one node of 8 H100 80GB (pytorch/torchtitan issue #1789, 2025-10-02, its log of
# steps 10-40; the config as torchtitan commit 82a9530 set it that day for H100s): FSDP over 8 GPUs (ZeRO 3), expert
# parallelism 8, 4 sequences of 4,096 tokens a GPU and step, bf16, selective activation checkpointing by operator,
# the loss compiled. 11,636, 11,758, 11,533 and 11,254 tokens/s a GPU: a step of 4 x 4,096 / 11,584.5 (their
# median) = 1.414 s, 73.32 GiB reserved at most.
PUBLISHED = {"tokens_per_s": (11_636, 11_758, 11_533, 11_254), "reserved_gib": 73.32}
TITAN = ["train.global_batch_size=32", "train.micro_batch_size=4", "parallel.ep=8", "parallel.zero=3"]


@pytest.mark.slow  # the 15.6B model's trace
def test_a_published_run_of_the_same_shape_lies_between_the_plans_two_bounds():
    """That run's layout planned on the H100 preset as shoal can express it: its recomputation by operator (the
    matrix products' outputs kept, every other one, the rest recomputed) lies between none and every block's, so
    its step and memory lie between the plan's two. This config is torchtitan's 16B flavour's shape (widths,
    experts, vocabulary) but for the attention (multi-head, not DeepSeek's latent attention) and the dense
    block's MLP (4 d GELU, not a SwiGLU of 10,944). docs/moe.md quotes the figures."""
    import statistics

    from shoal.layout import resolve_layout
    from shoal.plan.planner import Model, predict

    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
    model = Model.build(load_config(CONFIG, TITAN), cuda=True)
    measured = 4 * 4096 / statistics.median(PUBLISHED["tokens_per_s"])
    docs = " ".join((ROOT / "docs" / "moe.md").read_text().split())
    bounds = []
    for recompute in ("false", "true"):
        cfg = load_config(CONFIG, [*TITAN, f"precision.activation_checkpointing={recompute}"])
        pred = predict(model, cfg, resolve_layout(cfg, 8, True), profile)
        step, device = pred.step_time, pred.memory["device"] / 2 ** 30
        assert f"{step:.3f} s ({step / measured - 1:+.1%}) in {device:.1f} GiB" in docs, (step, device)
        bounds.append((step, device))
    (fast, big), (slow, small) = bounds
    assert fast < measured < slow and small < PUBLISHED["reserved_gib"] < big
    assert f"a step of {measured:.3f} s and {PUBLISHED['reserved_gib']} GiB reserved" in docs

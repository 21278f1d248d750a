"""The planner's context parallelism (parallel.cp, parallel/context.py): `shoal plan` considers cp for a model whose
sequences it can split (each divisor of dp whose head-tail chunks divide seq_len), counts a rank's activations and
compute as 1 / cp of each sequence's, and prices the gathers: per attention layer and micro-batch the keys and values
all-gathered in forward, gathered again and their gradients reduce-scattered in backward, once more under
recomputation."""

import pytest

from shoal.config import load_config
from shoal.hardware import HardwareProfile
from shoal.layout import resolve_layout
from shoal.plan.planner import context_exchange, plan
from shoal.plan.predict import _cp_comm

GPT = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.seq_len=256", "data.max_bytes=200000",
       "train.global_batch_size=8"]


def test_cp_is_planned_and_a_rank_holds_its_share_of_each_sequence():
    profile = HardwareProfile(matmul_flops={"fp32": 1e10}, collectives={
        op: [(1.0, 1e-3), (1e12, 1e-3)] for op in ("all_gather", "reduce_scatter", "all_reduce")})
    planned = {p.candidate.label(): p for p in plan(load_config(None, GPT), 2, profile, None) if p.ok}
    assert {"dp2 tp1 pp1 cp2 zero0 mb8", "dp2 tp1 pp1 cp2 zero3 ckpt mb2"} <= set(planned)
    cp, dp = planned["dp2 tp1 pp1 cp2 zero0 mb8"].prediction, planned["dp2 tp1 pp1 zero0 mb4"].prediction
    # 8 sequences halved on each rank against 4 whole ones: the same tokens, activations and compute
    assert cp.memory["activations"] == pytest.approx(dp.memory["activations"], rel=1e-3)
    assert cp.time["compute"] == pytest.approx(dp.time["compute"], rel=0.01)
    assert cp.time["comm"] > dp.time["comm"]  # the gathers, on the attention's path
    staged = {p.candidate.label() for p in plan(load_config(None, GPT), 4, profile, None) if p.ok}
    assert any("pp2 cp2" in label for label in staged), staged  # cp within pipeline stages


def test_the_gathers_are_priced_per_attention_layer_and_micro_batch():
    cfg = load_config(None, [*GPT, "parallel.cp=2"])
    layout = resolve_layout(cfg, 2, False)
    # 2 layers; keys and values of 8 sequences' 128 positions, 64 fp32 each
    assert context_exchange(cfg, layout) == (2, 2 * 8 * 128 * 64 * 4)
    assert context_exchange(load_config(None, GPT), resolve_layout(load_config(None, GPT), 2, False)) == (0, 0)
    staged = load_config(None, [*GPT, "parallel.cp=2", "parallel.pp=2", "train.micro_batch_size=2"])
    assert context_exchange(staged, resolve_layout(staged, 4, False))[0] == 1  # a stage's one attention layer
    flat = HardwareProfile(matmul_flops={"fp32": 1e10}, collectives={"all_gather": [(1.0, 1e-3), (1e12, 1e-3)],
                                                                     "reduce_scatter": [(1.0, 2e-3), (1e12, 2e-3)]})
    assert _cp_comm(flat, layout, 3, (2, 1000), False) == pytest.approx(3 * 2 * (2 * 1e-3 + 2e-3))
    assert _cp_comm(flat, layout, 3, (2, 1000), True) == pytest.approx(3 * 2 * (3 * 1e-3 + 2e-3))


@pytest.mark.slow  # imports transformers
def test_a_transformers_model_s_gathers_are_its_key_and_value_heads():
    pytest.importorskip("transformers")
    cfg = load_config(None, ['model.name="hf"', "model.seq_len=64", "parallel.cp=2", 'precision.dtype="bf16"',
                             'model.config={model_type="llama", hidden_size=64, intermediate_size=128, '
                             'num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2}',
                             "data.max_bytes=200000"])
    layout = resolve_layout(cfg, 2, False)
    # 2 key-value heads of 64 / 8 = 8: 16 wide; bf16
    assert context_exchange(cfg, layout) == (3, 2 * layout.micro_batch * 32 * 16 * 2)

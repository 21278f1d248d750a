"""Expert parallelism of transformers' mixtures of experts (parallel/experts.py): the block that stands in for a
Mixtral, Qwen2-MoE or Qwen3-MoE experts block (its choices sorted by expert, the experts' products as grouped GEMMs
over them, the results weighted and summed per token) computes what the block's own forward does, values and
gradients, here with every expert on one rank; tests/dist/test_hf_models.py splits them over ranks."""

import copy

import pytest
import torch

from shoal.config import load_config
from shoal.errors import UserError

pytestmark = pytest.mark.slow  # imports transformers
transformers = pytest.importorskip("transformers")

CONFIGS = {
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, head_dim=8),
    "mixtral": dict(model_type="mixtral", intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
}


def tiny(kind: str):
    """A one-layer model of `kind` with weights drawn to tell apart (transformers initialises the stacked experts'
    to zero here)."""
    config = transformers.AutoConfig.for_model(**CONFIGS[kind], hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_dispatch_computes_what_the_experts_block_does(kind):
    from shoal.parallel.experts import RoutedRows, TransformersExperts, transformers_experts

    [block] = [m for m in tiny(kind).modules() if transformers_experts(m)]
    ours = copy.deepcopy(block)
    ours.forward = RoutedRows(TransformersExperts(ours), 4)
    x = torch.randn(24, 32, requires_grad=True)
    chosen = torch.stack([torch.randperm(4)[:2] for _ in range(24)])  # 2 different experts a token
    weights = torch.rand(24, 2).softmax(-1)
    want, got = block(x, chosen, weights), ours(x, chosen, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (dx_want,) = torch.autograd.grad(want.square().sum(), x)
    grads_want = torch.autograd.grad(block(x, chosen, weights).square().sum(), list(block.parameters()))
    (dx_got, *grads_got) = torch.autograd.grad(got.square().sum(), [x, *ours.parameters()])
    torch.testing.assert_close(dx_got, dx_want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_bad_expert_parallelism_of_a_transformers_model_is_refused_in_one_line():
    from shoal.layout import resolve_layout

    config = ('model.config={model_type="mixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=1, '
              'num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2}')
    with pytest.raises(UserError) as e:
        resolve_layout(load_config(None, ['model.name="hf"', config, "parallel.ep=4"]), 4, cuda=False)
    assert "parallel.ep (4) must divide model.config.num_local_experts (6)" in str(e.value), str(e.value)
    # gpt-oss's experts block has biases and its gate and up interleaved: refused as preflight checks it
    from shoal.parallel.experts import expert_blocks

    gpt_oss = transformers.AutoConfig.for_model(model_type="gpt_oss", hidden_size=32, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8, num_local_experts=4, vocab_size=64)
    with pytest.raises(UserError, match="none of its experts blocks is one shoal can split"):
        expert_blocks(transformers.AutoModelForCausalLM.from_config(gpt_oss), 2)
    llama = ('model.config={model_type="llama", hidden_size=32, intermediate_size=32, num_hidden_layers=1, '
             'num_attention_heads=4}')
    with pytest.raises(UserError, match='model.name = "hf" has none'):
        resolve_layout(load_config(None, ['model.name="hf"', llama, "parallel.ep=2"]), 2, cuda=False)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_init_from_reads_a_hub_checkpoint_that_keeps_each_expert_apart(tmp_path, kind):
    """save_pretrained writes the stacked experts back per expert, under the Hub's names (Mixtral's
    block_sparse_moe.experts.3.w1.weight); init_from reads them into the stacked tensors as from_pretrained does."""
    from safetensors import safe_open

    from shoal.models.pretrained import check_pretrained, load_pretrained

    saved = tiny(kind)
    saved.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as sf:
        assert not any("gate_up_proj" in n for n in sf.keys()) and any(".experts.3." in n for n in sf.keys())
    fresh = transformers.AutoModelForCausalLM.from_config(saved.config, dtype=torch.float32)
    assert not isinstance(check_pretrained(fresh, tmp_path)["model.layers.0.mlp.experts.gate_up_proj"], str)
    load_pretrained(fresh, tmp_path)
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]) and torch.equal(v, saved.state_dict()[k]), k

"""Hugging Face models as shoal builds them, pretrained weights (model.init_from), train.freeze, and
the one-line errors of each: all in one process, without training."""

import re
import sys

import pytest
import torch
from safetensors.torch import save_file, save_model

from shoal.config import load_config
from shoal.errors import UserError, install_hint
from shoal.models.pretrained import check_pretrained, load_pretrained
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.training.build import freeze

TOKENS = DataSpec(kind="tokens", vocab_size=256)
LLAMA = ['model.name="hf"', "model.seq_len=16",
         'model.config={model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, '
         'num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32}']


def hf(*extra):
    pytest.importorskip("transformers")
    return build_model(load_config(None, [*LLAMA, *extra]).model, TOKENS)


def test_hf_model_declares_its_units_and_plan():
    bundle = hf()
    assert {t.__name__ for t in bundle.block_types} == {"LlamaDecoderLayer"}
    assert bundle.tensor_parallel is not None and bundle.items_name == "tokens"
    assert bundle.model.config.vocab_size == 256  # the data's vocabulary
    with pytest.raises(UserError, match=r"must divide the model's num_key_value_heads \(2\)"):
        bundle.tensor_parallel(bundle.model, 4)
    batch = {"input": torch.randint(0, 256, (2, 16)), "target": torch.randint(0, 256, (2, 16))}
    batch["target"][0, :4] = -1
    assert int(bundle.count_fn(batch)) == 28
    loss = bundle.loss_fn(bundle.model, batch)
    assert loss.item() == pytest.approx(28 * 5.545, rel=0.02)  # a sum over 28 tokens, near ln 256 each


def test_hf_without_its_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(UserError, match=re.escape(install_hint("hf"))):
        build_model(load_config(None, LLAMA).model, TOKENS)


def test_hf_config_errors_name_the_key(tmp_path):
    with pytest.raises(UserError, match="or model.config with a model_type"):
        build_model(load_config(None, ['model.name="hf"']).model, TOKENS)
    with pytest.raises(UserError, match="has no config.json"):
        build_model(load_config(None, ['model.name="hf"', f'model.path="{tmp_path}"']).model, TOKENS)
    with pytest.raises(UserError, match=r"model.seq_len \(64\) exceeds the model's 32 positions"):
        hf("model.seq_len=64")


def test_init_from_is_strict_and_ties_load_by_either_name(tmp_path):
    gpt = build_model(load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2"]).model, TOKENS).model
    save_model(gpt, str(tmp_path / "gpt.safetensors"))  # the tied head is stored once
    fresh = build_model(load_config(None, ["model.n_layer=1", "model.d_model=16", "model.n_head=2",
                                           "train.seed=7"]).model, TOKENS).model
    torch.manual_seed(99)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    load_pretrained(fresh, tmp_path / "gpt.safetensors")
    for (name, a), b in zip(gpt.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.head.weight is fresh.tok_emb.weight
    state = {k: v.clone() for k, v in gpt.state_dict().items() if k != "head.weight"}  # stored once, as above
    save_file({k: v for k, v in state.items() if k != "ln_f.bias"}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(UserError, match="has no weight ln_f.bias"):
        check_pretrained(fresh, tmp_path / "missing.safetensors")
    save_file({**state, "extra.w": torch.zeros(2)},
              str(tmp_path / "extra.safetensors"))
    with pytest.raises(UserError, match="1 weight.s. the model lacks, first extra.w"):
        check_pretrained(fresh, tmp_path / "extra.safetensors")
    torch.save(state, tmp_path / "pickled.bin")
    with pytest.raises(UserError, match="not a .safetensors file"):
        check_pretrained(fresh, tmp_path / "pickled.bin")


def test_freeze_patterns():
    model = hf().model
    assert freeze(model, ["model.layers.0.*"]) == 9
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[1].self_attn.q_proj.weight.requires_grad
    with pytest.raises(UserError, match="pattern 'layers.0.*' matches no parameter"):
        freeze(model, ["layers.0.*"])
    with pytest.raises(UserError, match="freezes every parameter"):
        freeze(model, ["*"])

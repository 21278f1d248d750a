"""A model built on the meta device and filled by replaying its recorded build (models/deferred.py,
parallel/materialize.py) has bitwise the weights one process builds from the same seed, leaves the
generator where that build leaves it, holds one parameter whole at a time, and reads model.init_from
tensor by tensor. The layouts' own parity from such a start: tests/dist/test_layouts.py and
tests/dist/test_sharded_start.py."""

import pytest
import torch
from safetensors.torch import save_model

from shoal.models.deferred import record, replay
from shoal.models.gpt import GPTConfig
from shoal.models.hf import HFConfig
from shoal.models.ncf import NCFConfig
from shoal.models.registry import build_model
from shoal.models.resnet import ResNetConfig
from shoal.models.spec import DataSpec
from shoal.parallel.materialize import Materializer
from shoal.training.build import build_deferred

TOKENS = DataSpec("tokens", vocab_size=256)
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "pad_token_id": 0}  # padding row zeroed: a view's write
MODELS = {
    "gpt": (GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=16), TOKENS),
    "resnet": (ResNetConfig(), DataSpec("images", num_classes=10, image_size=32)),
    "ncf": (NCFConfig(), DataSpec("interactions", num_users=50, num_items=80)),
    "hf-llama": (HFConfig(config=LLAMA, seq_len=16), TOKENS),
    "hf-gpt2": (HFConfig(config={"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}, seq_len=16), TOKENS),
    "hf-llama-lora": (HFConfig(config=LLAMA, seq_len=16, lora={"r": 4}), TOKENS),
}


def one_process(cfg, spec, seed=7):
    """Today's start: the model built whole on the CPU from the seed; and the generator's next draw."""
    torch.manual_seed(seed)
    model = build_model(cfg, spec, pretrained=True).model
    return model, torch.rand(8)


def deferred_start(cfg, spec, seed=7):
    torch.manual_seed(seed)
    bundle = build_deferred(cfg, spec)
    assert all(t.is_meta for t in bundle.model.parameters())
    filler = Materializer(bundle.deferred, torch.device("cpu"))
    filler.fill(bundle.model)
    return bundle.model, torch.rand(8), filler.whole_bytes


def assert_bitwise(model, ref):
    ours, theirs = model.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("name", list(MODELS))
def test_seeded_start_is_bitwise_one_process(name):
    if name.startswith("hf"):
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    cfg, spec = MODELS[name]
    ref, ref_next = one_process(cfg, spec)
    model, next_draw, _ = deferred_start(cfg, spec)
    assert_bitwise(model, ref)
    assert torch.equal(next_draw, ref_next)  # the generator ends where the build leaves it: dropout, data agree
    if name == "gpt":
        assert model.head.weight is model.tok_emb.weight  # tied weights stay one tensor


def test_replay_holds_one_parameter_whole_at_a_time():
    cfg = GPTConfig(n_layer=4, d_model=128, n_head=4, seq_len=16)
    _, _, whole = deferred_start(cfg, TOKENS)
    largest = 128 * 512 * 4  # mlp.up's weight, fp32
    assert whole == largest


def test_a_rank_computes_only_what_it_keeps_but_draws_everything():
    """Wanting one tensor runs only what it depends on, yet every random draw happens (on scratch), so the
    tensor and the generator after it are one process's."""
    cfg = GPTConfig(n_layer=4, d_model=64, n_head=4, seq_len=16)
    ref, ref_next = one_process(cfg, TOKENS)
    torch.manual_seed(7)
    model, rec = record(lambda r: build_model(cfg, TOKENS).model)
    got = {}
    target = model.blocks[2].mlp.down.weight
    replay(rec, {rec.ref(target): [lambda v: got.setdefault("w", v.clone())]})
    assert torch.equal(got["w"], ref.blocks[2].mlp.down.weight)
    assert torch.equal(torch.rand(8), ref_next)
    needed = sum(op.needed for op in rec.ops)
    assert needed <= 2 and len(rec.ops) > 50  # its normal_ (and its empty), out of the whole build


def test_a_resume_replays_no_draw_and_leaves_the_generator():
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=16)
    torch.manual_seed(7)
    bundle = build_deferred(cfg, TOKENS, init=False)
    before = torch.get_rng_state()
    Materializer(bundle.deferred, torch.device("cpu")).fill(bundle.model)
    assert torch.equal(torch.get_rng_state(), before)
    assert not any(p.is_meta for p in bundle.model.parameters())


def test_init_from_is_read_tensor_by_tensor(tmp_path):
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=16)
    torch.manual_seed(1)
    saved = build_model(cfg, TOKENS).model
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1.0)  # not what any seed gives
    save_model(saved, str(tmp_path / "w.safetensors"))
    pretrained = cfg.model_copy(update={"init_from": str(tmp_path / "w.safetensors")})
    ref, ref_next = one_process(pretrained, TOKENS)
    model, next_draw, whole = deferred_start(pretrained, TOKENS)
    assert_bitwise(model, ref)
    assert_bitwise(model, saved)
    assert torch.equal(next_draw, ref_next)  # the seeded init it replaces still drew, as one process's did
    assert whole == 64 * 256 * 4  # the largest tensor read: one at a time


@pytest.mark.slow
def test_llama3_8b_records_without_memory():
    """The full-size Llama 3 8B config's build is recorded (the first half of its sharded start) with every
    parameter on the meta device: 8.03B parameters, a log of some hundred operations, nothing allocated."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from pathlib import Path

    from shoal.config import load_config

    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "llama3-8b.toml"), [])
    bundle = build_deferred(cfg.model, TOKENS)
    params = list(bundle.model.parameters())
    assert sum(p.numel() for p in params) == 8_030_261_248 and all(p.is_meta for p in params)
    assert len(bundle.deferred.recording.ops) < 2000
    assert sum(t.nbytes for t in bundle.deferred.recording._alive if not t.is_meta) < 2**20  # constants only

"""configs/llama3-8b.toml, a Llama 3 8B job for one node of 8 GPUs: at full size it passes the checks a GPU
launch runs and builds on the meta device at Meta's 8,030,261,248 parameters, and `shoal plan` on the
H100 preset says that its own layout fits 80 GB and predicts its step. The planner traces a Hugging Face
Llama as a GPU runs it: attention fused, its key/value heads grouped, and the logits whole on every
tensor-parallel rank (the model's plan splits attention and MLPs only). The forward shoal runs
(hf.unpacked_rows) is transformers' own, bitwise. Meta device and a tiny model on the CPU (the
reduced-size config's parity on 4 ranks: tests/dist/test_llama3_8b.py)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from shoal import hardware
from shoal.config import load_config
from shoal.errors import UserError
from shoal.hardware import preset
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.plan.planner import Model, parse_bytes, plan
from shoal.preflight import check_job

if importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra is not installed", allow_module_level=True)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml"
N_PARAMS = 8_030_261_248  # Meta's model card: 8.03B
LAYOUT = "dp4 tp2 pp1 zero3 ckpt mb2"  # the config's own, on 8 GPUs
# the same config narrowed (as tests/dist/test_llama3_8b.py trains it): 4 query heads per key/value head as in
# Llama 3 8B; 256 positions so that a head's scores (T x T) are the largest tensor a materialised attention makes
SMALL = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=2", "model.config.vocab_size=256",
         "model.seq_len=256", "data.max_bytes=200000"]


@pytest.mark.slow  # the 8B model's meta build and the standard library's bytes: ~5 s
def test_full_size_passes_the_preflight_and_builds_on_meta(monkeypatch):
    """What `shoal train configs/llama3-8b.toml --nproc 8` checks on a node of 8 H100s (80 GB each, their
    memory as NVML reports it): the layout, the data, the model on meta, and that a rank's model state fits
    (the check runs: it refuses GPUs of 16 GiB)."""
    cfg = load_config(CONFIG)
    h100 = ("NVIDIA H100 80GB HBM3", 81_559 * 2 ** 20)
    monkeypatch.setattr(hardware, "gpu_memory", lambda: [h100] * 8)
    job = check_job(cfg, [8], cuda=True, quiet=True, local_workers=8)
    assert job.n_params == N_PARAMS
    layout = job.layouts[0]
    assert (layout.dims.dp, layout.dims.tp, layout.zero, layout.grad_accum, layout.backend) == (4, 2, 3, 1, "nccl")
    with on_meta():
        bundle = build_model(cfg.model, job.source.spec)
    model = bundle.model
    assert type(model).__name__ == "LlamaForCausalLM" and all(p.is_meta for p in model.parameters())
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (4096, 4096)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (1024, 4096)  # 8 key/value heads of 128
    assert model.model.layers[0].mlp.up_proj.weight.shape == (14336, 4096)
    assert model.lm_head.weight.shape == (128256, 4096) and model.lm_head.weight is not model.model.embed_tokens.weight
    assert sum(isinstance(m, bundle.block_types) for m in model.modules()) == 32  # the ZeRO 3 and recompute units
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == 500000.0 and model.config.rms_norm_eps == 1e-5
    monkeypatch.setattr(hardware, "gpu_memory", lambda: [("a 16 GiB GPU", 16 * 2 ** 30)] * 8)
    with pytest.raises(UserError, match="one rank needs .* but its GPU has 16.00 GiB"):
        check_job(cfg, [8], cuda=True, quiet=True, local_workers=8)


@pytest.mark.slow  # ~560 layouts of the 8B model: ~7 s
def test_plan_on_h100_says_the_config_fits_and_predicts_its_step():
    """As `shoal plan configs/llama3-8b.toml --nproc 8 --preset h100 --memory 80GB` plans it. The step is no
    shorter than the data sheet allows (6 N FLOPs a token at the H100's bf16 peak) and well under seconds."""
    cfg = load_config(CONFIG)
    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
    memory = parse_bytes("80GB")
    planned = {p.candidate.label(): p for p in plan(cfg, 8, profile, memory)}
    own = planned[LAYOUT]
    assert own.ok, own.reason
    state = 16 * N_PARAMS / 8  # fp32 weights, gradients and AdamW's two moments, sharded over 8 ranks
    assert state < own.prediction.memory["peak"] < memory
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    assert 6 * N_PARAMS * tokens / (8 * profile.matmul_flops["bf16"]) < own.prediction.step_time < 3.0
    assert not planned["dp4 tp2 pp1 zero3 mb2"].ok  # without recomputation 2 x 8,192 tokens do not fit


def test_the_trace_runs_grouped_attention_fused_and_keeps_the_logits_whole():
    model = Model.build(load_config(CONFIG, SMALL), cuda=True)
    cost = model.cost(1)
    names = {name for name, *_ in cost.ops.items}
    assert "_scaled_dot_product_flash_attention_for_cpu" in names  # the fused kernel, not its decomposition
    assert not names & {"_softmax", "_safe_softmax", "bmm"}
    scores = 8 * 256 * 256 * 4  # one layer's T x T scores for 8 heads, fp32: never made
    logits = 256 * 256 * 4
    assert max(cost.saved) < scores and max(cost.saved) == cost.largest >= logits
    outside_tp1, *_ = cost.on_rank(1.0, 1, False)
    outside_tp2, *_ = cost.on_rank(1.0, 2, False)
    assert outside_tp2 == outside_tp1  # embeddings, head and loss are whole on both tp ranks
    split = {id(p) for p in model.tp_split}
    bundle_model = model.bundle.model
    assert id(bundle_model.lm_head.weight) not in split and id(bundle_model.model.embed_tokens.weight) not in split
    assert len(split) == 7 * 2  # q, k, v, o, gate, up, down in each of 2 layers


def test_the_forward_without_a_host_read_is_transformers_own():
    """hf.unpacked_rows answers transformers' packed-sequence question without reading the device: the same
    logits, bitwise, as the model's own forward; and a forward on the meta device runs (the planner's)."""
    from transformers import masking_utils

    from shoal.models.hf import causal_lm_loss, unpacked_rows

    cfg = load_config(CONFIG, SMALL)
    torch.manual_seed(0)
    spec = DataSpec(kind="tokens", vocab_size=256)
    model = build_model(cfg.model, spec).model
    x = torch.randint(0, 256, (2, 32))
    with unpacked_rows():
        ours = model(input_ids=x, use_cache=False).logits
    assert torch.equal(ours, model(input_ids=x, use_cache=False).logits)
    assert masking_utils.find_packed_sequence_indices.__name__ == "find_packed_sequence_indices"  # put back
    with on_meta():
        meta = build_model(cfg.model, spec).model
    loss = causal_lm_loss(meta, {"input": x.to("meta"), "target": x.to("meta")})
    assert loss.is_meta and loss.shape == ()

"""configs/llama3-8b.toml, a Llama 3 8B job for one node of 8 GPUs: at full size it passes the checks a GPU
launch runs and builds on the meta device at Meta's 8,030,261,248 parameters, and `shoal plan` on the
H100 preset says that its own layout fits 80 GB and predicts its step. The planner traces a Hugging Face
Llama as a GPU runs it: attention fused, its key/value heads grouped, and the logits whole on every
tensor-parallel rank (the model's plan splits attention and MLPs only). The forward shoal runs
(hf.unpacked_rows) is transformers' own, bitwise. Meta device and a tiny model on the CPU (the
reduced-size config's parity on 4 ranks: tests/dist/test_llama3_8b_layout.py)."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from shoal import hardware
from shoal.config import load_config
from shoal.errors import UserError
from shoal.hardware import preset
from shoal.layout import resolve_layout
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.parallel.fit import rank_memory
from shoal.parallel.state_bytes import bundle_shape
from shoal.plan.planner import Model, parse_bytes, plan
from shoal.preflight import check_job

if importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra is not installed", allow_module_level=True)

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml"
N_PARAMS = 8_030_261_248  # Meta's model card: 8.03B
LAYOUT = "dp4 tp2 pp1 zero3 ckpt mb2"  # the config's own, on 8 GPUs
# A rank's model state under that layout, by hand. The model's tp plan (base_model_tp_plan) splits the decoder
# layers' q, o (4,096 x 4,096), k, v (1,024 x 4,096) and gate, up, down (14,336 x 4,096) over tp 2; the
# embedding and the output head (128,256 x 4,096 each, untied) and the RMSNorms stay whole on both tp ranks.
# ZeRO 3 then shards every tensor's first dimension over dp 4 (each divides): a split tensor is 1/8 on a rank, a
# whole one 1/4. fp32 weights, gradients and AdamW's two moments, 16 bytes an element, and AdamW's
# one-element step for each of the 291 tensors (9 a layer, the embedding, the head and the final norm).
V, H, FF, LAYERS = 128_256, 4096, 14_336, 32
SPLIT = LAYERS * (2 * H * H + 2 * 1024 * H + 3 * FF * H)
WHOLE = 2 * V * H + (2 * LAYERS + 1) * H
STATE = 16 * (SPLIT // 8 + WHOLE // 4) + 4 * (9 * LAYERS + 3)
# the same config narrowed (as tests/dist/test_llama3_8b_layout.py trains it): 4 query heads per key/value head as in
# Llama 3 8B; 256 positions so that a head's scores (T x T) are the largest tensor a materialised attention makes
SMALL = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=2", "model.config.vocab_size=256",
         "model.seq_len=256", "data.max_bytes=200000"]


@functools.cache
def full_size() -> Model:
    """The config's model as the planner prices it: built and traced once for this file's plans (the global batch,
    which the plans below change, is not part of it)."""
    return Model.build(load_config(CONFIG))


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


def test_a_rank_s_model_state_counts_the_embedding_and_head_whole():
    """The preflight's memory check (fit.rank_memory) on the full-size model on meta, under the config's layout:
    the hand count above, 2.1 GB more than if tp split the embedding and head too; on top, ZeRO 3's largest
    unit gathered with its gradients: the root (embedding, head and final norm, whole, in bf16)."""
    assert SPLIT + WHOLE == N_PARAMS
    assert STATE == 18_162_402_444  # 16.9 GiB
    # the embedding and head split by tp as well (what shoal counted before it read the model's plan)
    assert STATE - 16 * 2 * V * H // 8 == 16_061_056_140
    cfg = load_config(CONFIG)
    with on_meta():
        bundle = build_model(cfg.model, DataSpec(kind="tokens", vocab_size=256))
    shape = bundle_shape(bundle)
    need = rank_memory(shape, shape.params, resolve_layout(cfg, 8, True), cfg)
    assert need["params"] + need["grads"] + need["optimizer"] == STATE
    assert need["copies"] == 2 * 2 * (2 * V * H + H)


@pytest.mark.slow  # ~560 layouts of the 8B model: ~7 s
def test_plan_on_h100_says_the_config_fits_and_predicts_its_step():
    """As `shoal plan configs/llama3-8b.toml --nproc 8 --preset h100 --memory 80GB` plans it. The step is no
    shorter than the data sheet allows (6 N FLOPs a token at the H100's bf16 peak) and well under seconds."""
    cfg = load_config(CONFIG)
    profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
    memory = parse_bytes("80GB")
    planned = {p.candidate.label(): p for p in plan(cfg, 8, profile, memory, model=full_size())}
    own = planned[LAYOUT]
    assert own.ok, own.reason
    state = sum(own.prediction.memory[k] for k in ("params", "grads", "optimizer"))
    assert state == STATE  # as the preflight counts it (the embedding and head whole on both tp ranks)
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



def test_the_split_counted_is_the_one_dtensor_places(one_rank):
    """hf.tp_split_parameters reads the styles hf.tensor_parallel applies: after the model is split (over a
    mesh of one rank, which places the tensors as any tp does), its sharded parameters are those and only
    those: the decoder layers' projections, not the embedding, the head or the norms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shoal.models.tp_plan import split_parameters

    cfg = load_config(CONFIG, SMALL)
    bundle = build_model(cfg.model, DataSpec(kind="tokens", vocab_size=256))
    counted = {id(p) for p in split_parameters(bundle)}
    names = {n for n, p in bundle.model.named_parameters() if id(p) in counted}
    bundle.tensor_parallel(bundle.model, 1, init_device_mesh("cpu", (1,)))
    placed = {n for n, p in bundle.model.named_parameters()
              if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)}
    assert names == placed and len(placed) == 7 * 2
    assert not {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} & placed


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


@pytest.mark.slow  # three plans of the 8B model: ~20 s
def test_the_figures_quoted_from_the_plan_are_the_plans():
    """docs/gpus.md and this config's comments quote `shoal plan configs/llama3-8b.toml --nproc 8 --preset
    h100 --memory 80GB` (and, for torchtitan's layout, the same at a global batch of 16): the plan is their
    one source, recomputed here (tests/unit/test_figures.py holds the measured figures to theirs)."""
    def planned(sets=()):
        cfg = load_config(CONFIG, list(sets))
        profile = preset("h100").model_copy(update={"nproc": 8, "nnodes": 1})
        return {p.candidate.label(): p.prediction for p in plan(cfg, 8, profile, None, model=full_size())}

    def seconds(prediction, key="step"):
        return f"{prediction.time[key]:.2f} s"

    def gib(prediction, key):
        return f"{prediction.memory[key] / 2 ** 30:.1f} GiB"

    layouts = planned()
    own, fsdp, tp4 = layouts[LAYOUT], layouts["dp8 tp1 pp1 zero3 ckpt mb1"], layouts["dp2 tp4 pp1 zero3 ckpt mb2"]
    whole = layouts["dp4 tp2 pp1 zero3 mb1"]  # no recomputation
    budget = parse_bytes("80GB") / 2 ** 30  # --memory 80GB, in GiB
    tokens = 8 * 8192 / 8 / own.time["step"]
    docs = " ".join((CONFIG.parents[1] / "docs" / "gpus.md").read_text().split())
    for quoted in (f"a step of **{seconds(own)}** (compute {seconds(own, 'compute')}, exposed communication "
                   f"{seconds(own, 'comm')}: {round(tokens, -2):,.0f} tokens/s per GPU)",
                   f"**{gib(own, 'peak')} of tensors a rank**", f"**{gib(own, 'device')} on the device**",
                   f"(`dp8 tp1 pp1 zero3 ckpt mb1`) {seconds(fsdp)}", f"dp 2 x tp 4 {seconds(tp4)}",
                   f"does not fit ({gib(whole, 'device')} on the device against {budget:.1f})"):
        assert quoted in docs, quoted
    comments = " ".join(line.lstrip("#") for line in CONFIG.read_text().splitlines() if line.startswith("#"))
    comments = " ".join(comments.split())
    for quoted in (f"{gib(own, 'peak')} of tensors a rank, {gib(own, 'device')} on the device, a step of "
                   f"{seconds(own)}", f"({seconds(fsdp)} a step;", f"dp 2 x tp 4 slower ({seconds(tp4)},"):
        assert quoted in comments, quoted
    titan = planned(["train.global_batch_size=16"])["dp8 tp1 pp1 zero3 ckpt mb2"]
    assert (f"predicts {seconds(titan)} a step, {16 * 8192 / 8 / titan.time['step']:,.0f} tokens/s a GPU"
            in docs)

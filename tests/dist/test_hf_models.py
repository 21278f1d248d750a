"""Hugging Face models (model.name = "hf") train like the built-ins: tiny configs written here (a Llama- and a
GPT-2-architecture model, and Qwen2-MoE and Mixtral mixtures of experts with their routers' balance loss, 2 layers)
in dp 2, ZeRO 3, (Llama, from its own base_model_tp_plan) tp 2 and (the mixtures of experts) ep 2 against one
process with the same seed and global batch (fp32: losses and final weights within 1e-5). Then fine-tuning:
`shoal export --format hf` loads with from_pretrained and gives shoal's logits (an ep run's experts under their
own names); model.init_from starts a run at the exporting run's final validation loss; train.freeze leaves
parameters bitwise unchanged; LoRA (peft) trains with ZeRO 2 as in one process, resumes its checkpoint in another
layout, and its merged export reproduces its logits.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, read_weights
from harness import train as train_on_ranks
from shoal.checkpoint.export import export_hf

pytestmark = pytest.mark.slow  # every worker imports transformers and peft

if importlib.util.find_spec("transformers") is None:  # imported where used: collecting it cost every run ~0.7 s
    pytest.skip("the hf extra is not installed", allow_module_level=True)

STEPS = 8
COMMON = ['model.name="hf"', "model.seq_len=32", "data.max_bytes=200000", "train.val_batches=2",
          "metrics.tensorboard=false", "metrics.progress=false", f"train.steps={STEPS}", "train.warmup_steps=2",
          "train.global_batch_size=8", "train.micro_batch_size=2", "train.val_interval=0", "metrics.log_interval=1",
          "train.lr=3e-3"]
LLAMA = 'model.config={model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, ' \
        'num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64}'
GPT2 = 'model.config={model_type="gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, ' \
       'embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0}'
# a mixture of experts as transformers ships it, its router's balance loss asked for (output_router_logits)
QWEN_MOE = 'model.config={model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=32, ' \
           'shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, ' \
           'num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=true, ' \
           'router_aux_loss_coef=0.01}'
MIXTRAL = 'model.config={model_type="mixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=2, ' \
          'num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, ' \
          'max_position_embeddings=64, output_router_logits=true, router_aux_loss_coef=0.01}'
ARCH = {"llama": LLAMA, "gpt2": GPT2, "qwen2_moe": QWEN_MOE, "mixtral": MIXTRAL}
LAYOUTS = {"dp1": (1, []), "dp2": (2, []), "dp2-zero3": (2, ["parallel.zero=3"]), "tp2": (2, ["parallel.tp=2"]),
           "dp2-zero2-ac": (2, ["parallel.zero=2", "precision.activation_checkpointing=true"]),
           "dp2-ep2": (2, ["parallel.ep=2"]), "dp2-ep2-zero3": (2, ["parallel.ep=2", "parallel.zero=3"])}
LORA = ["model.lora={r=4, alpha=8.0, target_modules=['q_proj', 'v_proj']}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ranks):
    cache = {}

    def run(arch, layout, extra=()):
        key = (arch, layout, tuple(extra))
        if key not in cache:
            nproc, more = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(f"{arch}-{layout}") / "run"
            ranks(nproc).run(train_on_ranks, [*COMMON, ARCH[arch], *more, *extra], str(run_dir))
            cache[key] = run_dir
        return cache[key]
    return run


def assert_same(run_dir, ref_dir, keys=None):
    ours = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    ref = {m["step"]: m["loss"] for m in read_metrics(ref_dir)}
    assert sorted(ours) == sorted(ref) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s] for s in ref]), torch.tensor(list(ref.values())), rtol=1e-5, atol=0)
    w, ref_w = read_weights(run_dir), read_weights(ref_dir)
    assert w.keys() == ref_w.keys()
    for k in keys or ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("arch,layout", [("llama", "dp2"), ("llama", "dp2-zero3"), ("llama", "tp2"),
                                         ("llama", "dp2-zero2-ac"),
                                         ("gpt2", "dp2"), ("gpt2", "dp2-zero3"),
                                         ("qwen2_moe", "dp2"), ("qwen2_moe", "dp2-zero3"), ("qwen2_moe", "dp2-ep2-zero3"),
                                         ("mixtral", "dp2-zero3"), ("mixtral", "dp2-ep2")])
def test_hf_layouts_match_single_process(trained, arch, layout):
    ref = trained(arch, "dp1")
    losses = [m["loss"] for m in read_metrics(ref)]
    assert losses[-1] < losses[0] - 0.5  # it learns (byte-level text: ln 256 = 5.5 at the start)
    assert_same(trained(arch, layout), ref)
    if layout == "tp2":  # the plan split attention and MLP: each rank holds well under the whole model
        mem = json.loads((trained(arch, layout) / "summary.json").read_text())["memory_per_rank"]
        whole = json.loads((ref / "summary.json").read_text())["memory_per_rank"][0]["params"]
        assert all(r["params"] < 0.8 * whole for r in mem), mem


def test_export_hf_loads_with_from_pretrained_and_starts_a_fine_tune(tmp_path, trained, ranks):
    """export -> from_pretrained gives shoal's logits bitwise; export -> init_from: the fine-tune's step-0
    validation equals the exporting run's final one; train.freeze keeps what it names bitwise."""
    run = trained("llama", "dp2")
    out = tmp_path / "hf"
    export_hf(run, out)
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = read_weights(run)
    reference = transformers.AutoModelForCausalLM.from_config(loaded.config)
    reference.load_state_dict(ours)
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, reference.eval()(input_ids=x).logits)
    final_val = json.loads((run / "summary.json").read_text())["val_loss"]

    tune = tmp_path / "tune"
    frozen = ["model.embed_tokens.*", "model.layers.0.*"]
    ranks(2).run(train_on_ranks, [*COMMON, LLAMA, f'model.init_from="{out}"', "train.eval_on_start=true",
                                  f"train.freeze={json.dumps(frozen)}", "train.steps=3"], str(tune))
    summary = json.loads((tune / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(final_val, rel=1e-6)
    tuned = read_weights(tune)
    start = {k: v for k, v in ours.items()}
    for k, v in tuned.items():
        if k.startswith(("model.embed_tokens.", "model.layers.0.")):
            assert torch.equal(v, start[k]), k
        elif k.endswith("weight") and "norm" not in k:
            assert not torch.equal(v, start[k]), k  # the rest trained


def test_an_expert_parallel_run_exports_under_the_hub_names_and_starts_a_fine_tune(tmp_path, trained, ranks):
    """Mixtral's stacked experts split over 2 ep ranks are saved whole under their own names: the export loads with
    from_pretrained into the run's final weights, and a run started from it (init_from) with ep 2 validates at step 0
    as the exporting run did at its end."""
    run = trained("mixtral", "dp2-ep2")
    out = tmp_path / "hf"
    export_hf(run, out)
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    final = read_weights(run)
    assert "model.layers.0.mlp.experts.gate_up_proj" in final and loaded.keys() >= final.keys()
    for k, v in final.items():
        assert torch.equal(loaded[k], v), k
    tune = tmp_path / "tune"
    ranks(2).run(train_on_ranks, [*COMMON, MIXTRAL, "parallel.ep=2", f'model.init_from="{out}"',
                                  "train.eval_on_start=true", "train.steps=1"], str(tune))
    summary = json.loads((tune / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(json.loads((run / "summary.json").read_text())["val_loss"],
                                                        rel=1e-6)


def test_lora_trains_with_zero2_as_one_process_resumes_and_exports_merged(tmp_path, trained, ranks):
    ref = trained("llama", "dp1", LORA)
    losses = [m["loss"] for m in read_metrics(ref)]
    assert losses[-1] < losses[0]
    sharded = trained("llama", "dp2", [*LORA, "parallel.zero=2", "checkpoint.interval=4"])
    adapters = [k for k in read_weights(ref) if "lora_" in k]
    assert adapters
    assert_same(sharded, ref)
    assert_same(trained("llama", "dp2-zero3", LORA), ref)  # ZeRO 3: frozen and trained tensors in one unit
    # its step-4 checkpoint resumed by one process (another layout) ends where the one process did
    resumed = tmp_path / "resumed"
    shutil.copytree(sharded / "checkpoints" / "step_00000004", resumed / "checkpoints" / "step_00000004")
    ranks(1).run(train_on_ranks, [*COMMON, LLAMA, *LORA], str(resumed))
    assert [m["step"] for m in read_metrics(resumed)] == list(range(5, STEPS + 1))
    w_resumed, w_ref = read_weights(resumed), read_weights(ref)
    for k in w_ref:
        torch.testing.assert_close(w_resumed[k], w_ref[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    w = read_weights(ref)  # the base weights did not move: only the adapters trained
    assert all(not torch.equal(w[k], torch.zeros_like(w[k])) for k in adapters if "lora_B" in k)

    out = tmp_path / "merged"
    export_hf(ref, out)
    import transformers

    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in k for k in merged.state_dict())

    from shoal.config import load_config
    from shoal.models.registry import build_model
    from shoal.models.spec import DataSpec

    cfg = load_config(None, [*COMMON, LLAMA, *LORA])
    model = build_model(cfg.model, DataSpec(kind="tokens", vocab_size=256)).model
    model.load_state_dict(w)
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():  # merging adds (alpha/r) B A into W: the same function up to fp32 rounding
        torch.testing.assert_close(merged(input_ids=x).logits, model.eval()(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_init_from_another_architecture_is_refused_before_training(trained):
    from shoal.config import load_config
    from shoal.errors import UserError
    from shoal.preflight import check_job

    cfg = load_config(None, [*COMMON, LLAMA, f'model.init_from="{Path(trained("gpt2", "dp1")) / "model.safetensors"}"'])
    with pytest.raises(UserError, match=r"model.init_from = .* has no weight model.embed_tokens.weight"):
        check_job(cfg, [1], cuda=False)

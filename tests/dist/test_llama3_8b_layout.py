"""configs/llama3-8b.toml at reduced size (width and depth by --set; 4 query heads per key/value head, as in
Llama 3 8B) trains on 4 ranks of this machine in the config's own layout, ZeRO 3 x tp 2 with every decoder
layer recomputed, as one process trains it (tp 1, no ZeRO, no recomputation), step by step: the same
global batch of 8 (accumulated over 2 micro-batches of 2 on each dp rank, 4 in the one process).

fp32: losses and gradient norms within 1e-5 relative and the final weights within 1e-5, as every layout's
parity (tests/dist/test_layouts.py): only the order of sums differs (measured: losses equal, norms 2.8e-7,
weights 2.9e-6). bf16, the config's precision: losses within 1e-3 relative, gradient norms within 1e-2
(measured 3.9e-5 and 3.3e-4; test_bf16_matches_one_process says why they differ at all).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, read_weights
from harness import train as train_on_ranks

pytestmark = pytest.mark.slow  # every worker imports transformers

if importlib.util.find_spec("transformers") is None:
    pytest.skip("the hf extra is not installed", allow_module_level=True)

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "llama3-8b.toml")
STEPS = 3
SMALL = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=2", "model.config.vocab_size=256",
         "model.seq_len=32", "data.max_bytes=200000", f"train.steps={STEPS}", "train.val_interval=0",
         "train.val_batches=1", "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false",
         "checkpoint.enabled=false",
         # the config's 200 warmup steps would move the weights by ~lr / 200 in 3 steps: too little to compare
         "train.warmup_steps=0"]
ONE_PROCESS = ["parallel.tp=1", "parallel.zero=0", "precision.activation_checkpointing=false"]
PRECISION = {"fp32": ['precision.dtype="fp32"'], "bf16": []}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ranks):
    cache = {}

    def run(nproc: int, precision: str):
        key = (nproc, precision)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"llama3-{nproc}-{precision}") / "run"
            more = PRECISION[precision] + (ONE_PROCESS if nproc == 1 else [])
            out = ranks(nproc).run(train_on_ranks, [*SMALL, *more], str(run_dir), "auto", CONFIG, timeout=300)
            cache[key] = run_dir, out[0][1]
        return cache[key]
    return run


def steps(run_dir) -> tuple[torch.Tensor, torch.Tensor]:
    records = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    return torch.tensor([m["loss"] for m in records]), torch.tensor([m["grad_norm"] for m in records])


def test_fp32_matches_one_process(trained):
    run_dir, out = trained(4, "fp32")
    assert "dp 2 x tp 2 x pp 1, ZeRO 3" in out, out
    ref_dir, _ = trained(1, "fp32")
    (loss, norm), (ref_loss, ref_norm) = steps(run_dir), steps(ref_dir)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)  # Adam hides a gradient's scale; the norm does not
    w, ref_w = read_weights(run_dir), read_weights(ref_dir)
    assert w.keys() == ref_w.keys() and "lm_head.weight" in w  # the Hub's names, whole
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_bf16_matches_one_process(trained):
    """The config's own precision: bf16 autocast in both; tp 2 sums each row-parallel product's two halves,
    each rounded to bf16, where one process rounds the whole product once (8 mantissa bits: a relative
    rounding of 2^-9 per product). The weights are not compared: Adam moves each by ~lr (3e-4) a step
    whatever its gradient, so a tolerance that admits bf16's rounding would admit any update."""
    (loss, norm), (ref_loss, ref_norm) = steps(trained(4, "bf16")[0]), steps(trained(1, "bf16")[0])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-2, atol=0)

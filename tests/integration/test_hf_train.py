"""A GPT trained on a Hugging Face dataset through a Hugging Face tokenizer, both made in the test: the
launching process tokenizes once (the preflight), the two workers only open the cache, and the loss
falls from chance (ln of the vocabulary) to well below it. No third-party warning reaches the user on
either this run or a Hugging Face model's (transformers imports torchao wherever it is installed, as the
`fp8` extra installs it for the tests)."""

import json
import math
import re

from hf_corpus import documents, write_corpus

import shoal
from conftest import ROOT, run_cli

NOISE = re.compile(r"^[WIE]\d{4} |Warning|warn\(|Failed to load|Traceback")  # torch's logs, Python's warnings


def noise(output: str) -> list[str]:
    return [line for line in output.splitlines() if NOISE.search(line)]


def test_gpt_learns_a_tokenized_hf_dataset_cached_once_for_every_worker(tmp_path, capfd):
    data, tok = write_corpus(tmp_path / "corpus", documents(600))
    overrides = {"data.source": "hf", "data.path": str(data), "data.tokenizer": str(tok),
                 "data.cache_dir": str(tmp_path / "cache"), "model.n_layer": 2, "model.d_model": 64,
                 "model.seq_len": 32, "train.steps": 40, "train.global_batch_size": 16,
                 "train.micro_batch_size": 8, "train.lr": 3e-3, "train.warmup_steps": 5,
                 "train.val_interval": 0, "train.val_batches": 2, "metrics.log_interval": 1,
                 "metrics.progress": False, "metrics.tensorboard": False, "checkpoint.enabled": False}
    summary = shoal.train(overrides=overrides, nproc=2, run_dir=tmp_path / "run")
    out, err = capfd.readouterr()
    assert err.count("shoal: tokenizing") == 1  # the preflight's; the workers found the cache
    assert not noise(out + err)

    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    chance = math.log(300)  # the tokenizer's vocabulary
    assert abs(first["loss"] - chance) < 0.5
    assert summary["val_loss"] < chance - 3.5, summary  # the grammar is learnt, not only the unigrams


def test_a_hugging_face_models_run_prints_only_shoals_lines(tmp_path):
    """configs/llama3-8b.toml at its reduced size (the config's own comment), two steps."""
    small = [f"model.config.{k}={v}" for k, v in (("hidden_size", 64), ("intermediate_size", 128),
                                                   ("num_hidden_layers", 2), ("num_attention_heads", 8),
                                                   ("num_key_value_heads", 2), ("vocab_size", 256))]
    sets = [*small, "model.seq_len=32", "precision.dtype=fp32", "train.steps=2", "train.warmup_steps=1",
            "parallel.tp=1", "parallel.zero=0", "metrics.progress=false", "metrics.tensorboard=false"]
    r = run_cli(["train", ROOT / "configs/llama3-8b.toml", "--nproc", "1", "--run-dir", tmp_path / "run",
                 *[a for s in sets for a in ("--set", s)]], timeout=180)
    assert r.returncode == 0, r.output
    assert not noise(r.output), r.output
    assert "done: 2 steps" in r.output

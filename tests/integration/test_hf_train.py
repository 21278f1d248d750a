"""A GPT trained on a Hugging Face dataset through a Hugging Face tokenizer, both made in the test: the
launching process tokenizes once (the preflight), the two workers only open the cache, and the loss
falls from chance (ln of the vocabulary) to well below it."""

import json
import math

from hf_corpus import documents, write_corpus

import shoal


def test_gpt_learns_a_tokenized_hf_dataset_cached_once_for_every_worker(tmp_path, capfd):
    data, tok = write_corpus(tmp_path / "corpus", documents(600))
    overrides = {"data.source": "hf", "data.path": str(data), "data.tokenizer": str(tok),
                 "data.cache_dir": str(tmp_path / "cache"), "model.n_layer": 2, "model.d_model": 64,
                 "model.seq_len": 32, "train.steps": 40, "train.global_batch_size": 16,
                 "train.micro_batch_size": 8, "train.lr": 3e-3, "train.warmup_steps": 5,
                 "train.val_interval": 0, "train.val_batches": 2, "metrics.log_interval": 1,
                 "metrics.progress": False, "metrics.tensorboard": False, "checkpoint.enabled": False}
    summary = shoal.train(overrides=overrides, nproc=2, run_dir=tmp_path / "run")
    err = capfd.readouterr().err
    assert err.count("shoal: tokenizing") == 1  # the preflight's; the workers found the cache

    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    chance = math.log(300)  # the tokenizer's vocabulary
    assert abs(first["loss"] - chance) < 0.5
    assert summary["val_loss"] < chance - 3.5, summary  # the grammar is learnt, not only the unigrams

"""A small corpus and a BPE tokenizer trained on it, made in the test: nothing is downloaded."""

from __future__ import annotations

import random
from pathlib import Path

EOS = "<|endoftext|>"


def documents(n: int, seed: int = 0) -> list[str]:
    """Short English-like documents with a grammar a small model learns within a few dozen steps."""
    rng = random.Random(seed)
    words = {"adj": ["quick", "lazy", "red", "small"], "noun": ["fox", "dog", "cat", "bird"],
             "verb": ["jumps over", "looks at", "runs past"]}
    return [" ".join(f"the {rng.choice(words['adj'])} {rng.choice(words['noun'])} {rng.choice(words['verb'])} the "
                     f"{rng.choice(words['noun'])}." for _ in range(rng.randint(1, 4))) for _ in range(n)]


def train_tokenizer(texts: list[str], vocab_size: int = 300, special: tuple[str, ...] = (EOS,)):
    """A byte-level BPE (GPT-2's scheme) trained on `texts`; a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def write_corpus(folder: Path, texts: list[str], vocab_size: int = 300) -> tuple[Path, Path]:
    """`texts` as a parquet file and a tokenizer.json trained on them, in `folder`."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(folder / "docs.parquet"))
    train_tokenizer(texts, vocab_size).save(str(folder / "tokenizer.json"))
    return folder / "docs.parquet", folder / "tokenizer.json"

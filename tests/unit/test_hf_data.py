"""data.source = "hf": a Hugging Face dataset (parquet, jsonl, csv, save_to_disk) tokenized by a Hugging
Face tokenizer trained here, packed doc EOS doc EOS ..., cached on disk once and invalidated by any
change to what the tokens depend on."""

import re
import sys
import threading

import numpy as np
import pytest
import torch
from hf_corpus import EOS, documents, train_tokenizer, write_corpus

from shoal.config import DataConfig, load_config
from shoal.data import hf
from shoal.data.sources import build_source
from shoal.errors import UserError, install_hint

DOCS = documents(120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    data, tok = write_corpus(folder, DOCS)
    return folder, data, tok


def expected_stream(tok_path, docs, eos=EOS) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    out = []
    for d in docs:
        out += tok.encode(d, add_special_tokens=False).ids + [tok.token_to_id(eos)]
    return out


def hf_cfg(path, tok, cache, **kw) -> DataConfig:
    return DataConfig(source="hf", path=str(path), tokenizer=str(tok), cache_dir=str(cache), **kw)


def count_tokenize(monkeypatch) -> list:
    calls = []
    real = hf.tokenize
    monkeypatch.setattr(hf, "tokenize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv", "save_to_disk", "glob"])
def test_every_format_packs_documents_joined_with_eos_into_windows(corpus, tmp_path, fmt):
    import datasets  # here: importing it cost every collection of the suite ~0.5 s

    folder, parquet, tok = corpus
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS})
    if fmt == "jsonl":
        path = tmp_path / "docs.jsonl"
        ds.to_json(str(path))
    elif fmt == "csv":
        path = tmp_path / "docs.csv"
        ds.to_csv(str(path), index=False)
    elif fmt == "save_to_disk":  # a DatasetDict: data.split picks the split
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds.select(range(10)), "held": ds}).save_to_disk(str(path))
    elif fmt == "glob":  # two parquet shards, read in name order
        for i, part in enumerate((ds.select(range(50)), ds.select(range(50, len(DOCS))))):
            part.to_parquet(str(tmp_path / f"shard-{i}.parquet"))
        path = tmp_path / "shard-*.parquet"
    else:
        path = parquet
    cfg = hf_cfg(path, tok, tmp_path / "cache", split="held", val_fraction=0.1)
    src = build_source(cfg, seq_len=16)

    stream = expected_stream(tok, DOCS)
    tokens, vocab, _ = hf.hf_tokens(cfg)
    assert tokens.tolist() == stream and tokens.dtype == np.uint16  # vocab 300 fits 16 bits
    assert vocab == src.spec.vocab_size == 300
    n_val = int(len(stream) * 0.1)
    assert src.num_train == (len(stream) - n_val - 1) // 16
    b = src.train_batch(torch.tensor([0, 2]))
    assert b["input"][1].tolist() == stream[32:48] and b["target"][1].tolist() == stream[33:49]
    assert src.val_batch(torch.tensor([0]))["input"][0].tolist() == stream[-n_val:][:16]


def test_a_transformers_tokenizer_folder_gives_its_eos_and_added_tokens(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    _, parquet, _ = corpus
    tok = train_tokenizer(DOCS, special=("<s>", "</s>"))
    tok.enable_truncation(8)  # saved with a model's max length: documents must still be whole
    tok.enable_padding(length=64, pad_id=0, pad_token="<s>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_tokens(["<extra>"])  # added tokens count in the model's vocabulary
    fast.save_pretrained(str(tmp_path / "tok"))
    tokens, vocab, _ = hf.hf_tokens(hf_cfg(parquet, tmp_path / "tok", tmp_path / "cache", max_documents=5))
    assert vocab == len(fast) == 301
    tok.no_truncation()
    tok.no_padding()
    tok.save(str(tmp_path / "whole.json"))
    assert tokens.tolist() == expected_stream(tmp_path / "whole.json", DOCS[:5], eos="</s>")


def test_the_cache_is_reused_and_remade_when_what_the_tokens_depend_on_changes(corpus, tmp_path, monkeypatch):
    import datasets

    folder, parquet, tok = corpus
    calls = count_tokenize(monkeypatch)
    cfg = hf_cfg(parquet, tok, tmp_path / "cache")
    first = hf.hf_tokens(cfg)[0]
    bin_path = next((tmp_path / "cache").glob("*.bin"))
    mtime = bin_path.stat().st_mtime_ns
    again = hf.hf_tokens(cfg)[0]
    assert calls == [1] and bin_path.stat().st_mtime_ns == mtime and np.array_equal(first, again)
    assert isinstance(again, np.memmap)

    # two processes of a torchrun launch (threads here: the lock is per open file) tokenize once
    fresh = hf_cfg(parquet, tok, tmp_path / "race")
    threads = [threading.Thread(target=hf.hf_tokens, args=(fresh,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1, 1]

    assert hf.hf_tokens(hf_cfg(parquet, tok, tmp_path / "cache", max_documents=7))[0].tolist() == \
        expected_stream(tok, DOCS[:7])
    assert hf.hf_tokens(hf_cfg(parquet, tok, tmp_path / "cache", eos_token="the"))[0].tolist() == \
        expected_stream(tok, DOCS, eos="the")
    assert len(calls) == 4

    changed = tmp_path / "changed"  # a retrained tokenizer, then new data under the same file name
    _, tok2 = write_corpus(changed, DOCS[::-1], vocab_size=280)
    assert hf.hf_tokens(hf_cfg(parquet, tok2, tmp_path / "cache"))[0].tolist() == expected_stream(tok2, DOCS)
    for docs in (DOCS[:30], DOCS[30:60]):
        datasets.Dataset.from_dict({"text": docs}).to_parquet(str(changed / "docs.parquet"))
        tokens = hf.hf_tokens(hf_cfg(changed / "docs.parquet", tok2, tmp_path / "cache"))[0]
    assert tokens.tolist() == expected_stream(tok2, DOCS[30:60]) and len(calls) == 7


def test_mistakes_are_one_line_naming_the_key_and_the_fix(corpus, tmp_path, monkeypatch):
    import datasets

    folder, parquet, tok = corpus
    cache = tmp_path / "cache"

    def fails(match, seq_len=16, **kw):
        cfg = {"path": parquet, "tok": tok, "cache": cache} | kw
        with pytest.raises(UserError, match=match) as e:
            build_source(hf_cfg(cfg.pop("path"), cfg.pop("tok"), cfg.pop("cache"), **cfg), seq_len=seq_len)
        assert "\n" not in str(e.value)

    fails(r"data.path = '.*nowhere' does not exist; point it at a save_to_disk folder", path=tmp_path / "nowhere")
    fails(r"data.path = '.*\*.csv' matches no file", path=tmp_path / "*.csv")
    fails(r"data.text_column = 'body' is not a column of data.path = .*; its columns: text", text_column="body")
    (tmp_path / "bad.json").write_text("{not json")
    fails(r"data.tokenizer = '.*bad.json' is not a readable tokenizer.json", tok=tmp_path / "bad.json")
    (tmp_path / "empty").mkdir()
    fails(r"data.tokenizer = '.*empty' cannot be loaded by transformers.AutoTokenizer", tok=tmp_path / "empty")
    train_tokenizer(DOCS, special=("[PAD]",)).save(str(tmp_path / "no_eos.json"))
    fails(r"names no end-of-text token to put between documents; set data.eos_token", tok=tmp_path / "no_eos.json")
    fails(r"data.eos_token = '<eot>' is not in the vocabulary", eos_token="<eot>")
    fails(r"the data has \d+ tokens, too few for model.seq_len = 32", seq_len=32, max_documents=1)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(tmp_path / "dd"))
    fails(r"data.split = 'test' is not a split of .*; its splits: train", path=tmp_path / "dd", split="test")
    with pytest.raises(UserError, match='data.source = "hf" needs data.tokenizer; set it'):
        load_config(None, ['data.source="hf"', 'data.path="x.parquet"'])
    monkeypatch.setitem(sys.modules, "datasets", None)  # the hf extra not installed
    fails(r"""data.source = "hf" needs the datasets package; install it with: """ + re.escape(install_hint("hf")))


def test_where_the_tokens_are_cached_is_not_what_a_run_trains():
    from shoal.rundir import default_run_dir

    a, b = (load_config(None, ['data.source="hf"', 'data.path="d.parquet"', 'data.tokenizer="t.json"',
                               f'data.cache_dir="{d}"']) for d in ("x", "y"))
    assert default_run_dir(None, a) == default_run_dir(None, b)  # the same command resumes the same run


@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streamed"])
def test_packed_documents_end_at_the_eos_token(corpus, tmp_path, streaming):
    from tokenizers import Tokenizer

    folder, parquet, tok = corpus
    eos = Tokenizer.from_file(str(tok)).token_to_id(EOS)
    src = build_source(hf_cfg(parquet, tok, tmp_path / "cache", pack_documents=True, streaming=streaming), seq_len=64)
    b = src.val_batch(torch.tensor([0, 1]))
    ends = b["input"] == eos
    assert ends.any() and (b["target"][ends] == -1).all() and (b["target"][~ends] != -1).all()
    assert (b["positions"][:, 1:][ends[:, :-1]] == 0).all() and (b["positions"][:, 0] == 0).all()
    assert (b["positions"][:, 1:][~ends[:, :-1]] > 0).all()

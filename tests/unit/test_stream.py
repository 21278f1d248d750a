"""data.streaming (data/stream.py): documents tokenized as training reads them. Each dp rank reads every dp-th
training document and packs them as the cached stream is packed; validation is held-out documents no rank
trains on; the place a rank reached is state that continues the very windows; and nothing reads the corpus
whole before the first step. The corpus is local: a parquet file and a text file made here."""

from __future__ import annotations

import pytest
import torch
from hf_corpus import EOS, documents, write_corpus

from shoal.config import load_config
from shoal.data.sources import build_source
from shoal.data.stream import TrainStream
from shoal.errors import UserError

SEQ = 16
DOCS = 3000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    texts = documents(DOCS)
    data, tok = write_corpus(tmp_path_factory.mktemp("corpus"), texts)
    return texts, data, tok


def source(data, tok, **extra):
    sets = ['data.source="hf"', f'data.path="{data}"', f'data.tokenizer="{tok}"', "data.streaming=true",
            *[f"data.{k}={v}" for k, v in extra.items()]]
    return build_source(load_config(None, sets).data, SEQ)


def packed(src, texts: list[str]) -> list[int]:
    """The documents as the cached (not streamed) source packs them: each encoded, then EOS."""
    eos = src.tok.backend.token_to_id(EOS)
    out = []
    for enc in src.tok.backend.encode_batch(texts, add_special_tokens=False):
        out += [*enc.ids, eos]
    return out


def test_each_rank_packs_its_own_documents_and_none_is_held_out(corpus):
    texts, data, tok = corpus
    src = source(data, tok)
    every = src.every
    assert every == 20  # data.val_fraction 0.05
    train_docs = [t for i, t in enumerate(texts) if i % every]
    for rank in range(2):
        stream = src.train_stream(rank, 2)
        windows = stream.take(6)
        assert windows.shape == (6, SEQ + 1)
        mine = packed(src, train_docs[rank::2][:60])
        assert windows[:, :-1].flatten().tolist() == mine[:6 * SEQ]  # consecutive windows share a token
        assert windows[1:, 0].tolist() == windows[:-1, -1].tolist()
    val = packed(src, [t for i, t in enumerate(texts) if i % every == 0])
    assert src.val[:, :-1].flatten().tolist() == val[:src.num_val * SEQ]  # validation: held-out documents only


def test_its_place_continues_the_very_windows(corpus):
    _, data, tok = corpus
    src = source(data, tok)
    a = src.train_stream(1, 2)
    a.take(5)
    saved = {k: v.clone() for k, v in a.state().items()}
    after = a.take(7)
    b = src.train_stream(1, 2)
    b.load(saved)  # a new process resuming: it skips to the document reached, with the tokens left
    assert torch.equal(b.take(7), after)
    with pytest.raises(UserError, match=r"resume a streamed run with the dp it was saved with \(2\)"):
        src.train_stream(0, 4).load(saved)


def test_nothing_reads_the_corpus_whole_before_the_first_step(corpus):
    """Validation reads until it has its windows, a rank until it has a step's: a fraction of the corpus."""
    _, data, tok = corpus
    src = source(data, tok)
    stream = src.train_stream(0, 2)
    stream.take(16)  # a step of a global batch of 32 over dp 2
    assert stream.position < DOCS / 4, stream.position


def test_a_text_files_lines_are_its_documents_and_a_corpus_that_ends_says_so(corpus, tmp_path):
    texts, _, tok = corpus
    (tmp_path / "a.txt").write_text("\n".join(texts[:400]) + "\n")
    src = source(tmp_path / "a.txt", tok)
    stream = TrainStream(src, 0, 1)
    train_docs = [t for i, t in enumerate(texts[:400]) if i % src.every]
    assert stream.take(3)[:, :-1].flatten().tolist() == packed(src, train_docs[:30])[:3 * SEQ]
    with pytest.raises(UserError, match="ran out of documents"):
        stream.take(100_000)


def test_streaming_is_for_hf_and_a_rank_of_its_own():
    with pytest.raises(UserError, match=r'data.streaming = true reads a Hugging Face dataset .* not data.source = '
                                        r'"stdlib-text"'):
        load_config(None, ["data.streaming=true"])
    with pytest.raises(UserError, match='which balance.mode = "throughput" does not draw from'):
        load_config(None, ['data.source="hf"', 'data.path="x"', 'data.tokenizer="t"', "data.streaming=true",
                           'balance.mode="throughput"'])


def test_a_live_run_does_not_stream():
    from shoal.layout import check_live

    cfg = load_config(None, ['data.source="hf"', 'data.path="x"', 'data.tokenizer="t"', "data.streaming=true"])
    with pytest.raises(UserError, match="data.streaming = true keeps each dp rank's place .* cannot heal live"):
        check_live(cfg, (1, 2), 1)

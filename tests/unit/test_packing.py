"""Packed documents (data.pack_documents; data/packing.py, models/documents.py): a window's documents, each given
its own positions and kept apart in attention, train as they would one by one. Each token's loss in the packed
batch is that of its document given to the model alone (fp32, within 1e-5), for shoal's GPT and for a Hugging
Face Llama, and the packed batch's gradient is the documents' summed one (within 1e-5 of the largest); the sources give packed batches; a
packing the model cannot take is refused in one line."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shoal.config import Config, DataConfig
from shoal.data.packing import document_positions, window_batch
from shoal.data.sources import build_source
from shoal.errors import UserError
from shoal.models.documents import DocumentAttention

EOS = 3


def test_a_window_s_positions_restart_after_each_end_of_document_and_its_crossing_target_is_not_counted():
    w = np.array([[5, 6, EOS, 7, 8, 9, EOS, EOS, 4]])  # a cut document, a whole one, an empty one, a cut one
    b = window_batch(w, EOS)
    assert b["input"].tolist() == [[5, 6, EOS, 7, 8, 9, EOS, EOS]]
    assert b["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert b["target"].tolist() == [[6, EOS, -1, 8, 9, EOS, -1, -1]]
    assert set(window_batch(w, None)) == {"input", "target"}  # unpacked: one sequence, every target counted


def documents(batch) -> list[tuple[int, int, int]]:
    """(row, first, end) of every document of a packed batch."""
    out = []
    for row, pos in enumerate(batch["positions"].tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        out += [(row, a, b) for a, b in zip(starts, starts[1:], strict=False)]
    return out


def packed_batch(vocab: int, seq_len: int = 24) -> dict:
    g = torch.Generator().manual_seed(1)
    w = torch.randint(4, vocab, (3, seq_len + 1), generator=g)
    w[w % 5 == 0] = EOS  # documents of a few tokens each, ending anywhere
    return window_batch(w, EOS)


def token_losses(logits_of, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's loss in the packed batch, and in its document alone."""
    with DocumentAttention(batch["positions"]):
        packed = F.cross_entropy(logits_of(batch["input"], batch["positions"]).transpose(1, 2), batch["target"],
                                 ignore_index=-1, reduction="none")
    alone = torch.zeros_like(packed)
    for row, a, b in documents(batch):
        logits = logits_of(batch["input"][row:row + 1, a:b], None)
        alone[row, a:b] = F.cross_entropy(logits[0], batch["target"][row, a:b], ignore_index=-1, reduction="none")
    return packed, alone


def gpt():
    from shoal.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(name="gpt", seq_len=24, n_layer=2, n_head=2, d_model=32, dropout=0.0), 40)

    def logits_of(idx, positions):
        return model(idx, None, positions)

    return model, logits_of


def llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    from shoal.models.hf import unpacked_rows

    def logits_of(idx, positions):
        with unpacked_rows():  # as shoal calls it (models/hf.py): the mask is DocumentAttention's
            return model(input_ids=idx, position_ids=positions, use_cache=False).logits

    return model, logits_of


@pytest.mark.parametrize("build", [gpt, pytest.param(llama, marks=pytest.mark.slow)],  # slow: imports transformers
                         ids=["gpt", "llama"])
def test_each_token_s_loss_is_its_document_s_alone_and_so_is_the_gradient(build):
    model, logits_of = build()
    batch = packed_batch(40)
    assert len(documents(batch)) > 6 and (batch["target"] == -1).any()
    packed, alone = token_losses(logits_of, batch)
    assert (packed - alone).abs().max() < 1e-5 * alone.abs().max()
    counted = batch["target"] != -1
    assert (packed[~counted] == 0).all()

    model.zero_grad()
    packed.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone.sum().backward()
    # against the largest gradient: a key bias's is 0 up to rounding (softmax ignores a shift of every score)
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    worst = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert worst < 1e-5 * largest, (worst, largest)


def test_unpacked_windows_attend_across_documents_so_packing_changes_the_loss():
    model, logits_of = gpt()
    batch = packed_batch(40)
    whole = F.cross_entropy(logits_of(batch["input"], None).transpose(1, 2), batch["target"], ignore_index=-1,
                            reduction="none")
    packed, _ = token_losses(logits_of, batch)
    assert (whole - packed).abs().max() > 1e-3


def test_a_forward_that_never_calls_scaled_dot_product_attention_is_refused():
    with pytest.raises(UserError, match='attn_implementation = "eager".*data.pack_documents = false'):
        with DocumentAttention(torch.zeros(1, 4, dtype=torch.long)):
            torch.ones(2) * 2


def test_document_positions_count_from_each_document_s_first_token():
    t = torch.tensor([[EOS, 1, 1, EOS], [1, 1, 1, 1]])
    assert document_positions(t, EOS).tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]


def test_byte_sources_end_each_file_with_a_nul_byte_when_packed(tmp_path):
    for name, text in (("a.txt", "first file\n"), ("b.txt", "second one\n")):
        (tmp_path / name).write_text(text * 40)
    src = build_source(DataConfig(source="text", path=str(tmp_path), pack_documents=True, val_fraction=0.1), 32)
    stream = np.concatenate([src.train_tokens, src.val_tokens])
    assert (stream == 0).sum() == 1 and src.eos == 0  # between the two files; the last one ends the stream
    batch = src.train_batch(torch.arange(src.num_train))
    flat = batch["input"].flatten()
    after = torch.nonzero(flat == 0).flatten() + 1
    assert (batch["positions"].flatten()[after] == 0).all()
    assert set(build_source(DataConfig(source="text", path=str(tmp_path)), 32).train_batch(torch.arange(2))) == \
        {"input", "target"}


def test_a_token_file_s_end_of_document_token_is_data_eos_id(tmp_path):
    path = tmp_path / "t.bin"
    np.array([5, 6, 2, 7, 8, 9, 2] * 40, dtype=np.uint16).tofile(path)
    src = build_source(DataConfig(source="tokens", path=str(path), pack_documents=True, eos_id=2), 8)
    b = src.train_batch(torch.tensor([0]))
    assert b["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    with pytest.raises(ValueError, match="data.eos_id"):
        DataConfig(source="tokens", path=str(path), pack_documents=True)


@pytest.mark.parametrize(("changes", "message"), [
    ({"data": {"source": "synthetic-images", "pack_documents": True}, "model": {"name": "resnet"}},
     "packs the documents of a token stream"),
])
def test_packing_what_is_not_a_token_stream_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        Config.model_validate(changes)

"""The chunked cross-entropy (model.loss_chunks) against the plain loss over the whole logits: the same loss
and gradients, in fp32 within 1e-6 and under bf16 autocast within one bf16 rounding of the head's weight
gradient; and where it is refused (tensor and pipeline parallelism)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from shoal.config import load_config
from shoal.errors import UserError
from shoal.models.cross_entropy import chunked_cross_entropy, cross_entropy_sum
from shoal.models.gpt import GPTConfig, lm_loss
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.parallel.fit import check_model_fits

SPEC = DataSpec("tokens", vocab_size=256)


def head_inputs(tokens: int = 300, d: int = 32, vocab: int = 256):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(tokens, d, generator=g), torch.randn(vocab, d, generator=g) * 0.3
    target = torch.randint(vocab, (tokens,), generator=g)
    target[::7] = -1  # padding: not counted
    return hidden, weight, target


def loss_and_grads(chunks: int, dtype: torch.dtype | None, freeze_weight: bool = False):
    """(loss, d hidden, d weight) of half the loss (a scaled backward, as the loop's), plain for chunks = 0."""
    hidden, weight, target = head_inputs()
    hidden.requires_grad_()
    weight.requires_grad_(not freeze_weight)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        if chunks:
            loss = chunked_cross_entropy(hidden, weight, target, chunks)
        else:
            loss = cross_entropy_sum(F.linear(hidden, weight), target)
    (loss * 0.5).backward()
    return loss.detach(), hidden.grad, weight.grad


def largest_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to b's largest entry."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("chunks", [1, 4, 7])  # 7 does not divide the 300 tokens
def test_chunked_loss_equals_the_plain_loss_in_fp32(chunks):
    plain, chunked = loss_and_grads(0, None), loss_and_grads(chunks, None)
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-6, atol=0)
    for got, want in zip(chunked[1:], plain[1:], strict=True):
        assert largest_gap(got, want) < 1e-6


def test_chunked_loss_under_bf16_autocast():
    plain, chunked = loss_and_grads(0, torch.bfloat16), loss_and_grads(4, torch.bfloat16)
    assert chunked[1].dtype == plain[1].dtype == torch.float32  # as autocast hands the plain head's
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-6, atol=0)  # the loss is taken in fp32 both ways
    assert largest_gap(chunked[1], plain[1]) < 1e-6
    # the weight's gradient: bf16 chunk products summed in fp32 against one bf16 product (measured 3.7e-3)
    assert largest_gap(chunked[2], plain[2]) < 8e-3


def test_without_backward_or_a_gradient_for_the_weight():
    hidden, weight, target = head_inputs()
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, target, 3),
                                   cross_entropy_sum(hidden @ weight.T, target), rtol=1e-6, atol=0)
    _, hidden_grad, weight_grad = loss_and_grads(3, None, freeze_weight=True)
    assert weight_grad is None and largest_gap(hidden_grad, loss_and_grads(0, None)[1]) < 1e-6


def test_a_gpt_with_a_chunked_loss_trains_as_the_plain_one():
    torch.manual_seed(0)
    plain = build_model(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16), SPEC).model
    chunked = build_model(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, loss_chunks=4), SPEC).model
    chunked.load_state_dict(copy.deepcopy(plain.state_dict()))
    tokens = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input": tokens[:, :-1], "target": tokens[:, 1:]}
    losses = [lm_loss(m, batch) for m in (plain, chunked)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    grads = dict(plain.named_parameters())
    # against the largest gradient entry of all: the keys' biases have gradients of rounding size (softmax
    # does not see a shift shared by every key)
    largest = max(p.grad.abs().max() for p in plain.parameters())
    assert max((p.grad - grads[n].grad).abs().max() / largest for n, p in chunked.named_parameters()) < 1e-6
    assert chunked(batch["input"]).shape == (2, 16, 256)  # without a target: the logits, as before


def test_bad_chunk_count_is_one_line():
    with pytest.raises(UserError, match=r"^--set: model.loss_chunks = 0: must be greater than or equal to 1$"):
        load_config(None, ["model.loss_chunks=0"])


@pytest.mark.parametrize(("key", "why"), [("parallel.tp=2", "splits the logits over the vocabulary already"),
                                          ("parallel.pp=2", "the pipeline takes the last stage's loss")])
def test_refused_with_tensor_and_pipeline_parallelism(key, why):
    cfg = load_config(None, ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.loss_chunks=4", key])
    bundle = build_model(cfg.model, SPEC)
    with pytest.raises(UserError, match=f"^model.loss_chunks = 4 with parallel.*{why}.*; set model.loss_chunks = 1$"):
        check_model_fits(bundle, "gpt", cfg.parallel, cfg.precision)

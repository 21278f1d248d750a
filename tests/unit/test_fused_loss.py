"""model.fused_loss: the GPT's loss through torch.compile of the loss alone (the model eager), what an eager run
on a GPU takes by default. The same loss and gradients as the plain loss: in fp32 within 1e-6, under bf16 autocast
within one rounding of the bf16 logits' gradient; "auto" chooses it only on CUDA, outside a compiled model and for
plain logits. On the CPU through AOTAutograd (dynamo's trace is what the fusion rests on) and once through inductor
itself (slow tier: its C++ compile)."""

import copy

import pytest
import torch

from shoal.models import cross_entropy
from shoal.models.cross_entropy import cross_entropy_sum, fused_cross_entropy_sum
from shoal.models.gpt import GPTConfig, lm_loss, takes_fused_loss
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec


def loss_and_grad(fn, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 40, 300, generator=g) * 3).to(dtype).requires_grad_()
    target = torch.randint(300, (2, 40), generator=g)
    target[:, ::9] = -1  # padding: not counted
    loss = fn(logits, target)
    (loss * 0.25).backward()
    return loss.detach(), logits.grad


@pytest.fixture
def fresh_fused(monkeypatch):
    """The compiled loss made anew for this test (with the backend it sets)."""
    monkeypatch.setattr(cross_entropy, "_fused", None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_loss_equals_the_plain_loss(fresh_fused, dtype):
    with torch._dynamo.config.patch(debug_backend_override=">=0:aot_eager"):
        fused = loss_and_grad(fused_cross_entropy_sum, dtype)
    plain = loss_and_grad(cross_entropy_sum, dtype)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == dtype
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=0)
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}  # bf16: 2^-7
    torch.testing.assert_close(fused[1], plain[1], **tol)


@pytest.mark.slow  # inductor's C++ compile of the loss: ~10-40 s on 2 cores with its cache cold
def test_the_fused_loss_through_inductor(fresh_fused):
    fused, plain = loss_and_grad(fused_cross_entropy_sum, torch.float32), loss_and_grad(cross_entropy_sum, torch.float32)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=0)  # inductor's own reduction order
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-7)


def test_auto_takes_the_fused_loss_only_on_cuda_for_an_eager_model(fresh_fused, monkeypatch):
    calls = []
    monkeypatch.setattr("shoal.models.gpt.fused_cross_entropy_sum", lambda *a: calls.append(1) or cross_entropy_sum(*a))
    spec = DataSpec("tokens", vocab_size=64)
    batch = {"input": torch.randint(64, (2, 16)), "target": torch.randint(64, (2, 16))}
    for fused, expect in (("auto", 0), (True, 1), (False, 0)):  # the CPU: "auto" is the plain loss
        calls.clear()
        model = build_model(GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=16, fused_loss=fused), spec).model
        lm_loss(model, batch)
        assert len(calls) == expect, fused
    # under torch.compile "auto" stays plain (the compiled model holds its loss) and True fuses within the graph
    model = build_model(GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=16, fused_loss="auto"), spec).model
    calls.clear()
    with torch._dynamo.config.patch(debug_backend_override=">=0:aot_eager"):
        eager = lm_loss(copy.deepcopy(model), batch)
        compiled = lm_loss(torch.compile(model), batch)
    assert calls == []
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)


def test_auto_is_the_fused_loss_for_plain_logits_on_a_gpu_outside_a_compiled_model():
    on = {"cuda": True, "plain": True, "compiling": False}
    assert takes_fused_loss("auto", **on) and takes_fused_loss(True, **{**on, "cuda": False})
    for off in ({"cuda": False}, {"plain": False}, {"compiling": True}):  # the CPU, tp's DTensor, torch.compile
        assert not takes_fused_loss("auto", **{**on, **off}), off
    assert not takes_fused_loss(False, **on)

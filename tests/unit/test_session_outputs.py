"""A prepared model's forward in a Session runs under autocast and hands its bf16 or fp16 outputs back in fp32
(training/session_model.py), as Accelerate's prepare() does: on CUDA, mse_loss of a bf16 output against an fp32
target fails in its backward ("Found dtype Float but expected BFloat16"; the CPU's kernels promote instead)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from shoal.parallel.precision import Precision
from shoal.training.session_model import autocast_forward, in_fp32

Pair = namedtuple("Pair", "logits hidden")


class Outputs(OrderedDict):
    """As Hugging Face's ModelOutput: a dict whose items are also attributes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        setattr(self, key, value)


def test_every_low_precision_tensor_comes_back_in_fp32_and_the_rest_as_it_was():
    bf16, fp16, ids = torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16), torch.arange(2)
    out = in_fp32({"a": bf16, "b": [fp16, ids], "c": Pair(bf16, (fp16, "text")), "d": None})
    assert out["a"].dtype == out["b"][0].dtype == out["c"].logits.dtype == out["c"].hidden[0].dtype == torch.float32
    assert out["b"][1] is ids and out["c"].hidden[1] == "text" and out["d"] is None
    assert isinstance(out["c"], Pair) and isinstance(out["b"], list) and isinstance(out["c"].hidden, tuple)
    double = torch.ones(2, dtype=torch.float64)
    assert in_fp32(double) is double


def test_a_dict_output_comes_back_as_its_own_type_with_its_attributes_in_step_and_the_original_untouched():
    out = Outputs()
    out["logits"] = torch.ones(3, dtype=torch.bfloat16)
    got = in_fp32(out)
    assert type(got) is Outputs and got.logits.dtype == got["logits"].dtype == torch.float32
    assert out.logits.dtype == out["logits"].dtype == torch.bfloat16


def test_the_forward_computes_in_bf16_and_hands_back_fp32_with_its_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x, target = torch.randn(5, 4), torch.randn(5, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    out = autocast_forward(layer.forward, Precision("bf16", torch.device("cpu")))(x)
    assert out.dtype == torch.float32 and torch.equal(out, expected.float())
    torch.nn.functional.mse_loss(out, target).backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.weight.grad.abs().sum() > 0

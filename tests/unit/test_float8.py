"""precision.dtype = "fp8" (parallel/float8.py): each refusal in one line as a function of (device type,
compute capability, torchao installed), the layout's refusal of tensor parallelism, and, where torchao is
installed, which linear layers of a GPT the conversion swaps and one emulated step (float8 matmuls need a
GPU of compute capability 8.9; torchao emulates them on a CPU)."""

import sys

import pytest
import torch

from shoal.config import load_config
from shoal.errors import UserError
from shoal.layout import resolve_layout
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.parallel import float8
from shoal.preflight import check_job

needs_torchao = pytest.mark.skipif(not float8.torchao_installed(),
                                   reason="torchao is not installed (pip install 'shoal[fp8]')")


def test_fp8_trains_on_a_gpu_of_capability_8_9_or_newer_with_torchao():
    assert float8.refusal("cuda", (9, 0), torchao=True) is None  # H100
    assert float8.refusal("cuda", (8, 9), torchao=True) is None  # L4, L40S
    assert float8.refusal("cuda", (10, 0), torchao=True) is None  # B200


@pytest.mark.parametrize("device, capability, torchao, expected", [
    ("cpu", None, True, 'precision.dtype = "fp8" trains on NVIDIA GPUs of compute capability 8.9 or newer (L4, '
                        'L40S, H100, H200), not on the CPU; use "bf16"'),
    ("cpu", None, False, "not on the CPU"),  # the device first: torchao would not help
    ("cuda", (8, 0), True, 'precision.dtype = "fp8" needs float8 tensor cores (compute capability 8.9 or newer: '
                           'L4, L40S, H100, H200), but this GPU has compute capability 8.0; use "bf16"'),  # A100
    ("cuda", (8, 6), False, "this GPU has compute capability 8.6"),
    ("cuda", (9, 0), False, 'precision.dtype = "fp8" needs the torchao package; install it with: pip install '
                            "'shoal[fp8]'"),
])
def test_each_refusal_is_one_line(device, capability, torchao, expected):
    said = float8.refusal(device, capability, torchao)
    assert expected in said and "\n" not in said


def test_the_preflight_refuses_fp8_on_the_cpu_before_any_worker():
    with pytest.raises(UserError, match='"fp8" trains on NVIDIA GPUs .* not on the CPU'):
        check_job(load_config(None, ["precision.dtype=fp8"]), [1], cuda=False)
    with pytest.raises(UserError, match="not on the CPU"):  # a Session or a worker: at the conversion
        float8.float8_training(torch.nn.Linear(16, 16), "fp8", torch.device("cpu"))
    model = torch.nn.Linear(16, 16)
    assert float8.float8_training(model, "bf16", torch.device("cpu")) is model


def test_fp8_with_tensor_parallelism_is_refused_by_the_layout():
    cfg = load_config(None, ["precision.dtype=fp8", "parallel.tp=2"])
    with pytest.raises(UserError, match=r'precision.dtype = "fp8" with parallel.tp = 2 is not supported'):
        resolve_layout(cfg, 2, cuda=True)
    assert resolve_layout(load_config(None, ["precision.dtype=fp8", "parallel.zero=3"]), 2, cuda=True).zero == 3


def test_without_torchao_the_conversion_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if absent
    with pytest.raises(UserError, match=r"needs the torchao package; install it with: pip install 'shoal\[fp8\]'"):
        float8.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)))


def test_which_layers_convert():
    """Linear layers with both dimensions multiples of 16, but the output head (by name, or tied)."""
    assert float8.converts(torch.nn.Linear(32, 64), "blocks.0.mlp.up")
    assert not float8.converts(torch.nn.Linear(32, 40), "blocks.0.mlp.up")  # 40 % 16
    assert not float8.converts(torch.nn.Linear(24, 32), "blocks.0.mlp.up")
    assert not float8.converts(torch.nn.Linear(32, 64), "lm_head")
    assert not float8.converts(torch.nn.Linear(32, 64), "model.output")
    assert not float8.converts(torch.nn.LayerNorm(32), "ln_f")
    tied = torch.nn.Linear(32, 64)
    assert not float8.converts(tied, "proj", shared={id(tied.weight)})


def small_gpt(d_model: int = 32):
    cfg = load_config(None, ["model.n_layer=2", f"model.d_model={d_model}", "model.n_head=2", "model.seq_len=16"])
    torch.manual_seed(0)
    return build_model(cfg.model, DataSpec("tokens", vocab_size=256))


@needs_torchao
def test_the_conversion_swaps_the_blocks_linear_layers_and_keeps_the_tied_head():
    from torchao.float8.float8_linear import Float8Linear

    bundle = small_gpt()
    names = [n for n, _ in bundle.model.named_parameters()]
    model = float8.convert(bundle.model, emulate=True)
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert swapped == [f"blocks.{i}.{part}" for i in range(2)
                       for part in ("attn.k", "attn.proj", "attn.q", "attn.v", "mlp.down", "mlp.up")]
    assert type(model.head) is torch.nn.Linear and model.head.weight is model.tok_emb.weight
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints load across dtypes


@needs_torchao
def test_an_emulated_fp8_step_follows_bf16():
    """Forward and backward under bf16 autocast, the linear layers' matmuls in emulated float8: the loss
    within float8's error of bf16's, every gradient finite."""
    reference, converted = small_gpt(), small_gpt()
    float8.convert(converted.model, emulate=True)
    batch = {"input": torch.randint(0, 256, (4, 16)), "target": torch.randint(0, 256, (4, 16))}
    losses = []
    for bundle in (reference, converted):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = bundle.loss_fn(bundle.model, batch) / 64
        loss.backward()
        losses.append(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in bundle.model.parameters())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


@needs_torchao
def test_a_run_in_emulated_fp8_follows_bf16(tmp_path, monkeypatch):
    """The whole path (preflight, bf16 autocast, the conversion in parallelize, the MFU peak) in one
    process on the CPU, the refusal lifted and the float8 matmuls emulated: the loss curve within 0.5% of
    the same run in bf16."""
    from conftest import read_metrics, train_in_process

    convert, converted = float8.convert, []
    monkeypatch.setattr(float8, "check", lambda device: None)
    monkeypatch.setattr(float8, "convert", lambda model: converted.append(convert(model, emulate=True)) or model)
    sets = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=100000",
            "train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=8", "train.warmup_steps=2",
            "train.val_interval=0", "train.val_batches=1", "metrics.log_interval=1", "metrics.tensorboard=false",
            "metrics.progress=false", "checkpoint.enabled=false", "checkpoint.final_weights=false"]
    curves = []
    for dtype in ("bf16", "fp8"):
        train_in_process([*sets, f"precision.dtype={dtype}"], tmp_path / dtype)
        curves.append([m["loss"] for m in read_metrics(tmp_path / dtype) if "loss" in m])
    assert len(converted) == 1 and len(curves[1]) == 6
    assert curves[1] == pytest.approx(curves[0], rel=5e-3)  # measured: 1e-4 apart

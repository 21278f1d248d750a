"""precision.dtype = "fp8" (parallel/float8.py): each refusal in one line as a function of (device type,
compute capability, torchao installed), the fp8 keys' refusals (rowwise scaling with float8 all-gather; float8
all-gather without ZeRO 2/3), and, where torchao is installed, which linear layers of a GPT the conversion
swaps, for which recipe, which tensor-parallel styles they take, and one emulated step (float8 matmuls need a
GPU of compute capability 8.9; torchao emulates them on a CPU). The layouts: tests/dist/test_float8_layouts.py."""

import re
import sys

import pytest
import torch

from shoal.config import load_config
from shoal.errors import UserError, install_hint
from shoal.layout import resolve_layout
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.parallel import float8
from shoal.preflight import check_job

needs_torchao = pytest.mark.skipif(not float8.torchao_installed(),
                                   reason="torchao is not installed (pip install -e '.[fp8]')")


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
    ("cuda", (9, 0), False, 'precision.dtype = "fp8" needs the torchao package; install it with: {hint}'),
])
def test_each_refusal_is_one_line(device, capability, torchao, expected):
    said = float8.refusal(device, capability, torchao)
    assert expected.replace("{hint}", install_hint("fp8")) in said and "\n" not in said


def test_the_preflight_refuses_fp8_on_the_cpu_before_any_worker():
    with pytest.raises(UserError, match='"fp8" trains on NVIDIA GPUs .* not on the CPU'):
        check_job(load_config(None, ["precision.dtype=fp8"]), [1], cuda=False)
    fp8 = load_config(None, ["precision.dtype=fp8"]).precision
    with pytest.raises(UserError, match="not on the CPU"):  # a Session or a worker: at the conversion
        float8.float8_training(torch.nn.Linear(16, 16), fp8, torch.device("cpu"))
    model = torch.nn.Linear(16, 16)
    assert float8.float8_training(model, load_config(None, []).precision, torch.device("cpu")) is model


def test_fp8_takes_every_layout_and_float8_all_gather_only_where_zero_gathers():
    for layout in (["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.zero=3"]):
        assert resolve_layout(load_config(None, ["precision.dtype=fp8", *layout]), 2, cuda=True)
    cfg = load_config(None, ["precision.dtype=fp8", "precision.fp8_all_gather=true"])
    with pytest.raises(UserError) as e:
        resolve_layout(cfg, 2, cuda=True)
    assert str(e.value) == ("precision.fp8_all_gather = true gathers ZeRO 2/3's weights in float8, but "
                            'parallel.zero = 0 gathers none; set parallel.zero = 2 or 3, or fp8_all_gather = "auto"')


def test_rowwise_scaling_with_float8_all_gather_is_refused_in_one_line():
    with pytest.raises(UserError) as e:
        load_config(None, ["precision.fp8_recipe=rowwise", "precision.fp8_all_gather=true"])
    said = str(e.value)
    assert "\n" not in said and said.endswith(
        'precision.fp8_all_gather = true with precision.fp8_recipe = "rowwise" is not supported (torchao gathers '
        'weights in float8 with one scale per tensor only); set fp8_all_gather = false or "auto", or fp8_recipe = '
        '"tensorwise"')
    with pytest.raises(UserError, match=r"precision.fp8_all_gather = 'yes' must be true, false or \"auto\""):
        load_config(None, ['precision.fp8_all_gather="yes"'])
    with pytest.raises(UserError, match="precision.fp8_recipe = 'blockwise': must be 'tensorwise' or 'rowwise'"):
        load_config(None, ["precision.fp8_recipe=blockwise"])


@pytest.mark.parametrize("sets, zero, gathers", [
    ([], 3, True), ([], 2, True), ([], 0, False),  # "auto" with tensorwise scaling: wherever ZeRO gathers
    (["precision.fp8_all_gather=false"], 3, False),
    (['precision.fp8_recipe="rowwise"'], 3, False),  # "auto" with rowwise: torchao cannot
])
def test_where_float8_all_gather_is_on(sets, zero, gathers):
    assert load_config(None, ["precision.dtype=fp8", *sets]).precision.gathers_float8(zero) is gathers
    assert not load_config(None, ["precision.dtype=bf16", *sets]).precision.gathers_float8(zero)


def test_without_torchao_the_conversion_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if absent
    with pytest.raises(UserError, match=re.escape(f"needs the torchao package; install it with: {install_hint('fp8')}")):
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
    # under tensor parallelism each rank's shard must still be a multiple of 16
    assert float8.converts(torch.nn.Linear(32, 64), "blocks.0.mlp.up", tp=2)
    assert not float8.converts(torch.nn.Linear(48, 64), "blocks.0.mlp.up", tp=2)  # 48 / 2 = 24


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
@pytest.mark.parametrize("recipe, granularity", [("tensorwise", "TENSORWISE"), ("rowwise", "AXISWISE")])
def test_the_recipe_and_float8_all_gather_reach_each_layer(recipe, granularity):
    from torchao.float8.float8_linear import Float8Linear

    model = float8.convert(small_gpt().model, recipe, all_gather=recipe == "tensorwise", emulate=True)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 12
    for m in layers:
        c = m.config
        assert {x.scaling_granularity.name for x in (c.cast_config_input, c.cast_config_weight,
                                                     c.cast_config_grad_output)} == {granularity}
        assert c.enable_fsdp_float8_all_gather is (recipe == "tensorwise") and c.emulate


@needs_torchao
@pytest.mark.parametrize("recipe, nccl, expected", [
    # NCCL: every float8 layer by torchao's float8 style, the sequence gathered in float8 for attn and mlp
    ("tensorwise", True, {"Float8ColwiseParallel": 8, "Float8RowwiseParallel": 4, "PrepareFloat8ModuleInput": 4}),
    # gloo: only where nothing float8 crosses ranks (q, k, v, mlp.up take a gathered, replicated input)
    ("tensorwise", False, {"Float8ColwiseParallel": 8, "RowwiseParallel": 4, "PrepareModuleInput": 4}),
    ("rowwise", True, {"ColwiseParallel": 8, "RowwiseParallel": 4, "PrepareModuleInput": 4}),
])
def test_float8_layers_take_torchao_s_tensor_parallel_styles(recipe, nccl, expected):
    """The GPT's sequence-parallel plan with its float8 layers' styles swapped (the head and tok_emb, not in
    float8, keep theirs; norms and the dropout's split are not layers' styles)."""
    from shoal.models import gpt_parallel, tp_plan

    model = float8.convert(small_gpt().model, recipe, tp=2, emulate=True)
    plan = gpt_parallel.styles(model, sequence_parallel=True)
    styles = tp_plan.float8_styles(model, plan, carries_float8=nccl)
    blocks = {n: type(s).__name__ for n, s in styles.items() if n.startswith("blocks.") and not n.endswith(
        ("ln1", "ln2"))}
    assert {k: list(blocks.values()).count(k) for k in set(blocks.values())} == expected
    assert styles["head"] is plan["head"] and styles["tok_emb"] is plan["tok_emb"]
    for name in ("blocks.0.attn.proj", "blocks.1.mlp.down"):  # the layouts carried over: scattered by sequence
        assert styles[name].output_layouts == plan[name].output_layouts


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
    monkeypatch.setattr(float8, "convert", lambda model, *args, **kwargs: converted.append(
        convert(model, *args, **kwargs, emulate=True)) or model)
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

"""The preflight's memory check (parallel/fit.py): a layout whose model state cannot fit one rank's device
is refused before any worker starts, in one line naming what one rank needs, of what, and what the device
has. The device's memory is a probe a test replaces (shoal/hardware.py); the figures are checked against
the arithmetic done by hand for a GPT whose parameters are counted below."""

import ctypes

import pytest
import torch

from shoal import compat, hardware
from shoal.cli import main
from shoal.config import load_config
from shoal.errors import UserError
from shoal.layout import resolve_layout
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.tp_plan import split_parameters
from shoal.parallel.fit import rank_memory
from shoal.parallel.state_bytes import bundle_shape, shape_of
from shoal.preflight import check_job

GiB = 2 ** 30
D, LAYERS, VOCAB, SEQ = 1024, 8, 256, 32  # the default data's bytes: a vocabulary of 256
GPT = [f"model.n_layer={LAYERS}", f"model.d_model={D}", "model.n_head=8", f"model.seq_len={SEQ}",
       "data.max_bytes=200000", "train.global_batch_size=8", "train.micro_batch_size=2"]
# by hand: a block is q, k, v, proj (d x d + d each), up (4d x d + 4d), down (d x 4d + d), two LayerNorms (2d
# each); outside the blocks the token embedding (tied to the head), the positions and the final LayerNorm
BLOCK = 4 * (D * D + D) + (4 * D * D + 4 * D) + (4 * D * D + D) + 2 * 2 * D
P = LAYERS * BLOCK + VOCAB * D + SEQ * D + 2 * D  # 101,066,752 parameters
TENSORS = LAYERS * 16 + 4  # AdamW keeps a one-element fp32 step for each
# ZeRO 1 over 4 ranks deals whole tensors, largest first, each to the least loaded rank: each rank takes 4 of
# the 16 matrices of 4d x d and 8 of the 32 of d x d, then rank 0 the embedding, which leaves it the largest
# (the positions and the 4d and d vectors go to the others); 2 fp32 moments an element, a step a tensor
ZERO1_ADAMW = 8 * (4 * 4 * D * D + 8 * D * D + VOCAB * D) + 13 * 4


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def fake_gpus(monkeypatch, size: float, count: int = 4) -> None:
    monkeypatch.setattr(hardware, "gpu_memory", lambda: [("Fake GPU", int(size))] * count)


def test_the_gpt_s_parameters_are_counted_by_hand():
    cfg = load_config(None, GPT)
    with on_meta():
        model = build_model(cfg.model, check_job(cfg, [1], cuda=False).source.spec).model
    assert sum(p.numel() for p in model.parameters()) == P == 101_066_752
    assert len(list(model.parameters())) == TENSORS


def test_a_model_that_fits_under_zero_3_but_not_zero_1_is_refused_under_zero_1(monkeypatch):
    fake_gpus(monkeypatch, 0.75 * GiB)
    check_job(load_config(None, [*GPT, "parallel.zero=3"]), [4], cuda=True, local_workers=4)  # fits
    with pytest.raises(UserError) as refused:
        check_job(load_config(None, [*GPT, "parallel.zero=1"]), [4], cuda=True, local_workers=4)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"parallel.zero = 1 on dp 4 x tp 1 x pp 1: one rank needs {gib(8 * P + ZERO1_ADAMW)} for "
                           f"the model state (parameters {gib(4 * P)}, gradients {gib(4 * P)}, AdamW state "
                           f"{gib(ZERO1_ADAMW)}), ")
    assert "but its GPU has 0.75 GiB (Fake GPU); activations come on top, so no micro-batch size makes it fit" in line
    zero3 = P + P + (2 * P + TENSORS * 4) + 2 * 4 * BLOCK  # see the next test
    assert f"parallel.zero = 3 needs {gib(zero3)}" in line
    assert line.endswith("parallel.memory_check = false starts it anyway")


def test_the_figures_are_the_hand_arithmetic(monkeypatch):
    """ZeRO 3 over dp 4 in fp32 with AdamW: a quarter of every tensor (each first dimension divides by 4), so
    P bytes of parameters, P of gradients, 2P of moments + 4 bytes of step per tensor; on top, the largest
    block gathered whole with its gradients (the blocks outweigh the embeddings)."""
    fake_gpus(monkeypatch, 0.25 * GiB)
    cfg = load_config(None, [*GPT, "parallel.zero=3"])
    with pytest.raises(UserError) as refused:
        check_job(cfg, [4], cuda=True, local_workers=4)
    need = {"params": P, "grads": P, "optimizer": 2 * P + TENSORS * 4, "copies": 4 * BLOCK + 4 * BLOCK}
    assert (f"one rank needs {gib(sum(need.values()))} for the model state (parameters {gib(P)}, gradients "
            f"{gib(P)}, AdamW state {gib(2 * P + TENSORS * 4)}, gathered for compute {gib(8 * BLOCK)}), but its GPU "
            f"has 0.25 GiB (Fake GPU)") in str(refused.value)
    # the state in all, 16 bytes a parameter and the steps: at least that many ranks of 0.25 GiB
    whole = 16 * P + TENSORS * 4
    assert f"(the state is {gib(whole)} in all: fully sharded, at least {-(-whole // (GiB // 4))} ranks" \
        in str(refused.value)
    with on_meta():
        model = build_model(cfg.model, check_job(load_config(None, GPT), [1], cuda=False).source.spec)
    shape = shape_of(model.model, model.block_types)

    def memory(*sets: str) -> dict:
        c = load_config(None, [*GPT, *sets])
        return rank_memory(shape, shape.params, resolve_layout(c, 4, True), c)

    assert memory("parallel.zero=3") == need
    assert memory("parallel.zero=1") == {"params": 4 * P, "grads": 4 * P, "optimizer": ZERO1_ADAMW, "copies": 0}
    # bf16: the same fp32 state (master weights), the block gathered in 16 bits
    assert memory("parallel.zero=3", 'precision.dtype="bf16"') == {**need, "copies": 2 * BLOCK + 2 * BLOCK}
    assert memory("parallel.zero=3", 'train.optimizer="sgd"', "train.momentum=0.9")["optimizer"] == P
    assert memory("parallel.zero=3", 'train.optimizer="sgd"', "train.momentum=0")["optimizer"] == 0
    # ZeRO 0: everything whole, nothing gathered; bf16 adds autocast's copies of the weight matrices
    matrices = LAYERS * 12 * D * D + VOCAB * D + SEQ * D
    assert memory("parallel.zero=0") == {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P + TENSORS * 4, "copies": 0}
    assert memory("parallel.zero=0", 'precision.dtype="bf16"')["copies"] == 2 * matrices


# what the GPT's tp plan (gpt_parallel.styles) splits: q, k, v, proj, up and down, the column-parallel layers'
# biases (q, k, v and up: 7d), the token embedding (tied to the head); what it leaves whole on every tp rank:
# proj's and down's biases, the LayerNorms, the position table
SPLIT = LAYERS * (12 * D * D + 7 * D) + VOCAB * D
WHOLE = LAYERS * (2 * D + 2 * 2 * D) + SEQ * D + 2 * D


def test_tp_splits_what_the_gpt_s_plan_splits_and_no_more():
    """ZeRO 3 over dp 2 x tp 2 in fp32 with AdamW: a split tensor is a quarter on each rank, a whole one half
    (every first dimension divides); the largest block gathered with its gradients, its tp part."""
    assert SPLIT + WHOLE == P
    cfg = load_config(None, [*GPT, "parallel.zero=3", "parallel.tp=2"])
    with on_meta():
        bundle = build_model(cfg.model, check_job(load_config(None, GPT), [1], cuda=False).source.spec)
    shape = bundle_shape(bundle)
    elements = SPLIT // 4 + WHOLE // 2
    block = (12 * D * D + 7 * D) // 2 + 6 * D
    assert rank_memory(shape, shape.params, resolve_layout(cfg, 4, True), cfg) == {
        "params": 4 * elements, "grads": 4 * elements, "optimizer": 8 * elements + TENSORS * 4,
        "copies": 2 * 4 * block}
    # without tp the split does not count: the shape the preflight then makes leaves the plan unread
    assert bundle_shape(bundle, tp_split=False).split is None and len(split_parameters(bundle)) == LAYERS * 10 + 1



def test_the_split_counted_is_the_one_dtensor_places(one_rank):
    """ModelBundle.tp_split reads the styles tensor_parallel applies (tp_plan.split_by): after the GPT is
    split (here over a mesh of one rank, which places the tensors as any tp does), its sharded parameters are
    those and only those."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=16",
                             "data.max_bytes=200000"])
    bundle = build_model(cfg.model, check_job(cfg, [1], cuda=False).source.spec)
    counted = {id(p) for p in split_parameters(bundle)}
    names = {n for n, p in bundle.model.named_parameters() if id(p) in counted}
    bundle.tensor_parallel(bundle.model, 1, init_device_mesh("cpu", (1,)))
    placed = {n for n, p in bundle.model.named_parameters()
              if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)}
    assert names == placed
    assert "pos_emb.weight" not in placed and "blocks.0.attn.proj.bias" not in placed and "tok_emb.weight" in placed


def test_the_cpu_shares_the_node_s_available_memory_among_its_workers(monkeypatch):
    cfg = load_config(None, GPT)  # ZeRO 0 over 2 ranks: 16P + the steps each
    need = 16 * P + TENSORS * 4
    monkeypatch.setattr(hardware, "available_memory", lambda: 2 * need - 2)
    with pytest.raises(UserError, match=f"this node has {gib(2 * need - 2)} available, {gib(need - 1)} for each of "
                                        f"its 2 workers"):
        check_job(cfg, [2], cuda=False, local_workers=2)
    check_job(cfg, [2], cuda=False)  # the workers of the node not known: not checked
    monkeypatch.setattr(hardware, "available_memory", lambda: 2 * need)
    check_job(cfg, [2], cuda=False, local_workers=2)


def test_the_command_line_refuses_in_one_line_before_any_worker_starts(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hardware, "available_memory", lambda: GiB)
    code = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), *[a for s in GPT for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("shoal: error: parallel.zero = 0 on dp 2 x tp 1 x pp 1: one rank needs ") and \
        err.count("\n") == 1, err
    assert "this node has 1.00 GiB available, 0.50 GiB for each of its 2 workers" in err
    assert not (tmp_path / "run").exists()


def test_memory_check_false_starts_it_anyway_and_an_unreadable_device_is_not_checked(monkeypatch):
    fake_gpus(monkeypatch, 0.25 * GiB)
    check_job(load_config(None, [*GPT, "parallel.zero=1", "parallel.memory_check=false"]), [4], cuda=True,
              local_workers=4)
    monkeypatch.setattr(hardware, "gpu_memory", lambda: None)
    check_job(load_config(None, [*GPT, "parallel.zero=1"]), [4], cuda=True, local_workers=4)


def test_workers_sharing_a_gpu_share_its_memory(monkeypatch):
    """gloo lets several workers take one GPU (r mod the GPUs): each gets its share."""
    fake_gpus(monkeypatch, 0.8 * GiB, count=2)  # ZeRO 3 over 4 ranks needs 0.47 GiB a rank
    cfg = load_config(None, [*GPT, "parallel.zero=3", 'parallel.backend="gloo"'])
    check_job(cfg, [4], cuda=True, local_workers=2)
    with pytest.raises(UserError, match=r"its GPU has 0.80 GiB \(Fake GPU, shared by 2 workers\)"):
        check_job(cfg, [4], cuda=True, local_workers=4)


def test_a_pipeline_rank_holds_its_stages_and_offload_keeps_the_state_in_cpu_memory(monkeypatch):
    fake_gpus(monkeypatch, 1.5 * GiB)
    # pp 2: each rank holds half the blocks (~0.75 GiB of state), the whole model would not fit
    check_job(load_config(None, [*GPT, "parallel.pp=2"]), [2], cuda=True, local_workers=2)
    with pytest.raises(UserError, match="parallel.zero = 0 on dp 1 x tp 1 x pp 1"):
        check_job(load_config(None, GPT), [1], cuda=True, local_workers=1)
    # offload: the GPU holds the gathered block, the node's memory the state of its 4 workers
    fake_gpus(monkeypatch, 0.1 * GiB)
    offload = load_config(None, [*GPT, "parallel.zero=3", "parallel.offload=true"])
    monkeypatch.setattr(hardware, "available_memory", lambda: 64 * GiB)
    check_job(offload, [4], cuda=True, local_workers=4)
    monkeypatch.setattr(hardware, "available_memory", lambda: GiB)
    with pytest.raises(UserError, match=r"needs 0\.\d\d GiB of CPU memory under parallel.offload = true \(parameters"):
        check_job(offload, [4], cuda=True, local_workers=4)


class _FakeNvml:
    """libnvidia-ml's calls visible_gpus makes, answering as two 80 GiB GPUs of compute capability 9.0 would."""

    def __init__(self):
        self.shut = False

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 100 + index.value
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        memory._obj.total = 80 * GiB
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = 9, 0
        return 0

    def nvmlDeviceGetName(self, handle, name, length):
        name.value = b"Fake H100"
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0


def test_gpu_memory_is_read_from_nvml_without_a_cuda_context(monkeypatch):
    """The launcher forks its workers after the preflight: asking NVML makes no CUDA context. Without a
    driver (this machine) there is nothing to read; with one (faked here), each visible GPU's total."""
    if not torch.cuda.is_available():
        assert compat.visible_gpu_memory() is None
    assert not torch.cuda.is_initialized()
    nvml = _FakeNvml()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: nvml)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: i)
    assert compat.visible_gpu_memory() == [("Fake H100", 80 * GiB)] * 2 and nvml.shut
    assert compat.visible_gpus() == [("Fake H100", 80 * GiB, (9, 0))] * 2
    assert not torch.cuda.is_initialized()

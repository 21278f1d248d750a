import pytest

from shoal.config import load_config
from shoal.errors import UserError
from shoal.plan import make_plan


def test_derived_accumulation():
    cfg = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=8"])
    plan = make_plan(cfg, 2)
    assert (plan.dims.dp, plan.grad_accum, plan.per_rank_batch) == (2, 4, 32)
    assert "global batch 64 = micro 8 x dp 2 x accumulation 4; 8,192 tokens per step" in plan.describe(cfg, "tokens", 128)


def test_batch_not_divisible():
    cfg = load_config(None, ["train.global_batch_size=30", "train.micro_batch_size=8"])
    with pytest.raises(UserError) as e:
        make_plan(cfg, 2)
    assert "train.global_batch_size (30) must be divisible by train.micro_batch_size (8) x dp (2) = 16" in str(e.value)


def test_fp16_on_cpu_is_refused():
    cfg = load_config(None, ["precision.dtype=fp16"])
    with pytest.raises(UserError, match='"fp16" needs CUDA'):
        make_plan(cfg, 1)


def test_nccl_without_cuda_is_refused():
    cfg = load_config(None, ["parallel.backend=nccl"])
    with pytest.raises(UserError, match="needs CUDA"):
        make_plan(cfg, 1)

"""precision.dtype = "fp8" under each layout that splits it, on 2 gloo ranks, with torchao's float8 matmuls
emulated (the CPU has no float8 tensor cores; the casts, scales and collectives are the real ones): tensor
parallelism through torchao's float8 styles, with sequence parallelism, ZeRO 3 gathering its weights in
float8 (and resumed from its checkpoint), and rowwise scaling under tensor parallelism. Each against one
process in fp8 of the same recipe and against one process in bf16.

Stated tolerance, for every layout and both references: every step's loss within 1e-3 relative (measured at
most 2.8e-4), and the weights' whole change over the run (final - initial, all parameters as one vector)
within 15% of the reference's change in norm (measured at most 7.4%). fp8 against one process in fp8 is no
closer than against bf16, although the float8 casts take the same scales (an amax over a DTensor reduces
over the tp ranks; ZeRO's precomputed scales reduce over the shards): a split matmul sums its partial
products in another order, and one bf16 ulp of difference flips an element's rounding to e5m2 (2 mantissa
bits, 12.5% steps) in the gradients, which Adam's normalisation carries into the weights they update (in
bf16, tp 2 against one process differs by 2%; a wrong or missing reduction by 100% and more).
"""

import functools

import pytest
import torch
from test_layouts import BASE, SAVED, STEPS, losses

from conftest import read_weights
from harness import train as train_on_ranks
from shoal.config import load_config
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.parallel import float8

pytestmark = pytest.mark.skipif(not float8.torchao_installed(), reason="torchao is not installed (pip install "
                                "-e '.[fp8]')")

LOSS_RTOL, CHANGE_RTOL = 1e-3, 0.15
FP8 = ['precision.dtype="fp8"']
# name -> (processes, overrides)
RUNS = {"one-bf16": (1, ['precision.dtype="bf16"']), "one-fp8": (1, FP8),
        "one-rowwise": (1, [*FP8, 'precision.fp8_recipe="rowwise"']),
        "tp2": (2, [*FP8, "parallel.tp=2"]), "tp2-sp": (2, [*FP8, "parallel.tp=2", "parallel.sequence_parallel=true"]),
        "zero3": (2, [*FP8, "parallel.zero=3"]),  # precision.fp8_all_gather = "auto": on
        "tp2-rowwise": (2, [*FP8, "parallel.tp=2", 'precision.fp8_recipe="rowwise"'])}


def train_emulated(env, overrides: list[str], run_dir: str, resume: str = "auto") -> dict:
    """harness.train with fp8 allowed on the CPU and its matmuls emulated. Returns what this rank's run did in
    float8: the tensor-parallel styles applied ({class name: layers}), the weight-scale precomputes and the
    float8 gathers of FSDP2 (torchao's fsdp_pre_all_gather of a float8 weight)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from shoal.models import tp_plan

    seen = {"styles": {}, "scales": 0, "gathers": 0}
    check, convert, styles, scales = float8.check, float8.convert, tp_plan.float8_styles, float8.WeightScales.__call__
    gather = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def counted_styles(*args):
        out = styles(*args)
        for s in out.values():
            seen["styles"][type(s).__name__] = seen["styles"].get(type(s).__name__, 0) + 1
        return out

    def counted_scales(self):
        seen["scales"] += 1
        return scales(self)

    @functools.wraps(gather)  # FSDP2 reads the hook's signature
    def counted_gather(self, *args, **kwargs):
        seen["gathers"] += 1
        return gather(self, *args, **kwargs)

    float8.check = lambda device: None  # the CPU's refusal lifted: the conversion below emulates
    float8.convert = functools.partial(convert, emulate=True)
    tp_plan.float8_styles, float8.WeightScales.__call__ = counted_styles, counted_scales
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = counted_gather
    try:  # the ranks' processes serve other tests after this one: put everything back
        train_on_ranks(env, overrides, run_dir, resume)
    finally:
        float8.check, float8.convert, tp_plan.float8_styles = check, convert, styles
        float8.WeightScales.__call__ = scales
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = gather
    return seen


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ranks):
    """Each run once per module: (run dir, what rank 0's run did in float8)."""
    cache = {}

    def run(name):
        if name not in cache:
            nproc, extra = RUNS[name]
            run_dir = tmp_path_factory.mktemp(name) / "run"
            cache[name] = (run_dir, ranks(nproc).run(train_emulated, [*BASE, *extra], str(run_dir))[0])
        return cache[name]
    return run


@functools.cache
def initial_weights() -> dict[str, torch.Tensor]:
    """The weights every run starts from: the GPT built after the run's seed (a run's start replays that build)."""
    cfg = load_config(None, BASE)
    torch.manual_seed(cfg.train.seed)
    return build_model(cfg.model, DataSpec("tokens", vocab_size=256)).model.state_dict()


def assert_follows(run_dir, ref_dir):
    """The stated tolerance (module docstring): losses step by step, and the weights' change as a whole."""
    ours, ref = losses(run_dir), losses(ref_dir)
    assert sorted(ours) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s] for s in ref]), torch.tensor([ref[s] for s in ref]),
                               rtol=LOSS_RTOL, atol=0)
    init, w, ref_w = initial_weights(), read_weights(run_dir), read_weights(ref_dir)
    assert w.keys() == ref_w.keys()
    change = torch.cat([(w[k] - init[k]).flatten() for k in sorted(ref_w)])
    ref_change = torch.cat([(ref_w[k] - init[k]).flatten() for k in sorted(ref_w)])
    off = ((change - ref_change).norm() / ref_change.norm()).item()
    assert off < CHANGE_RTOL, f"the weights' change is {off:.1%} off the reference's"


def slow(*names):
    return [pytest.param(n, marks=pytest.mark.slow) for n in names]


# layout -> (the one-process fp8 run of its recipe, the styles it applied over gloo: {class: layers}); the head and
# tok_emb never train in float8
EXPECTED = {
    "tp2": ("one-fp8", {"Float8ColwiseParallel": 8, "Float8RowwiseParallel": 4, "ColwiseParallel": 1,
                        "RowwiseParallel": 1}),
    # gloo has no float8 type: the sequence is gathered in bf16 (PrepareModuleInput), and proj and mlp.down, whose
    # output is scattered over the sequence, keep RowwiseParallel (their float8 gradient would be gathered back)
    "tp2-sp": ("one-fp8", {"Float8ColwiseParallel": 8, "RowwiseParallel": 5, "ColwiseParallel": 1,
                           "PrepareModuleInput": 4, "SequenceParallel": 5, "PrepareModuleOutput": 1}),
    # torchao's float8 styles take tensorwise scales only: rowwise layers keep DTensor's plain styles
    "tp2-rowwise": ("one-rowwise", {"ColwiseParallel": 9, "RowwiseParallel": 5}),
}


@pytest.mark.parametrize("layout", ["tp2", *slow("tp2-sp", "tp2-rowwise")])
def test_fp8_tensor_parallel_layouts_follow_one_process(trained, layout):
    run_dir, seen = trained(layout)
    reference, styles = EXPECTED[layout]
    assert seen["styles"] == styles
    assert_follows(run_dir, trained(reference)[0])
    assert_follows(run_dir, trained("one-bf16")[0])


def test_zero3_gathers_fp8_weights_in_float8_and_follows_one_process(trained):
    """Every block's and the root's float8 weights gathered in float8 (6 per block and forward or backward
    gather), their scales computed once after each step."""
    run_dir, seen = trained("zero3")
    assert seen["scales"] == STEPS and seen["gathers"] > 0, seen
    assert_follows(run_dir, trained("one-fp8")[0])
    assert_follows(run_dir, trained("one-bf16")[0])


@pytest.mark.slow
def test_zero3_in_float8_resumes_as_it_ran(tmp_path, ranks, trained):
    """The step-3 checkpoint of the float8-gathering run loads into a new one (the float8 weights' wrapper
    saved and loaded by DCP), whose scales are computed from the loaded weights before its first gather; it
    ends as the uninterrupted run did."""
    first = trained("zero3")[0]
    nproc, extra = RUNS["zero3"]
    seen = ranks(nproc).run(train_emulated, [*BASE, *extra], str(tmp_path / "run"),
                            str(first / "checkpoints" / f"step_{SAVED:08d}"))[0]
    assert seen["scales"] == 1 + STEPS - SAVED, seen  # once at the load, then after each step
    ours, ref = losses(tmp_path / "run"), losses(first)
    assert sorted(ours) == list(range(SAVED + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s] for s in ours]), torch.tensor([ref[s] for s in ours]),
                               rtol=1e-6, atol=0)

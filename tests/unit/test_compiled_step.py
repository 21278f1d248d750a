"""train.compile: the loss function is compiled over the model (compiled_loss, what parallelize installs), so
the loss and its fp32 upcast run in the compiled region and train as eager does (tests/integration/
test_compile.py: the same through DDP at dp 2, and each pipeline stage compiled); CUDA graphs (the
reduce-overhead and max-autotune modes) are refused in one line where a layout cannot replay them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.config import load_config
from shoal.errors import UserError
from shoal.layout import check_cuda_graphs, resolve_layout
from shoal.models.cross_entropy import chunked_cross_entropy
from shoal.parallel.apply import compiled_loss


def test_the_loss_trains_in_the_compiled_region_as_eager():
    traced = []

    def loss_fn(model, batch):
        traced.append(torch.compiler.is_compiling())
        # as a Hugging Face model's loss: the upcast and the cross-entropy outside the model's forward; and the
        # chunked head's autograd Function, which dynamo traces (one compile for both: compiling costs seconds)
        plain = F.cross_entropy(model(batch["x"]).float(), batch["y"], reduction="sum")
        return plain + chunked_cross_entropy(model[:2](batch["x"]), model[2].weight, batch["y"], 3)

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5, bias=False))
    model = copy.deepcopy(eager)
    compiled = compiled_loss(loss_fn, "default")
    runs = []
    for m, fn in ((eager, loss_fn), (torch.compile(model), compiled)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            batch = {"x": torch.randn(8, 8, generator=g), "y": torch.randint(5, (8,), generator=g)}
            loss = fn(m, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append(torch.stack(losses))
    assert traced == [False] * 3 + [True] * 3  # the compiled function's body ran under dynamo, loss included
    # inductor fuses and reorders float ops: equal up to rounding, not bitwise
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_compile_takes_torch_compile_modes():
    assert load_config(None, ["train.compile=max-autotune-no-cudagraphs"]).train.compile == "max-autotune-no-cudagraphs"
    with pytest.raises(UserError, match=r"^--set: train.compile = 'fast' must be true, false or one of torch.compile's "
                                        r'modes: "default", "reduce-overhead", "max-autotune", "max-autotune-no-'):
        load_config(None, ["train.compile=fast"])


@pytest.mark.parametrize(("setting", "refusal"), [
    ("parallel.pp=2", "parallel.pp = 2: a pipeline schedule keeps several micro-batches' forwards in flight"),
    ("parallel.zero=3", "parallel.zero = 3 (FSDP2) gathers and frees the parameters every step"),
    ("parallel.zero=2", "parallel.zero = 2 (FSDP2) gathers and frees the parameters every step"),
    ("balance.mode=throughput", 'balance.mode = "throughput" changes each rank\'s micro-batch size'),
])
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_refused_where_the_layout_cannot_replay_them(mode, setting, refusal):
    with pytest.raises(UserError) as e:
        load_config(None, [f"train.compile={mode}", setting])
    assert str(e.value).startswith(f'--set: train.compile = "{mode}" captures CUDA graphs, but {refusal}')
    assert str(e.value).endswith("or train.compile = true (no CUDA graphs)") and "\n" not in str(e.value)
    load_config(None, ["train.compile=true", setting])  # compiled without CUDA graphs: taken


def test_cuda_graphs_need_the_workers_on_cuda():
    cfg = load_config(None, ["train.compile=reduce-overhead", "train.global_batch_size=8", "train.micro_batch_size=4"])
    assert resolve_layout(cfg, 2, cuda=True).device == "cuda"
    for refused in (lambda: resolve_layout(cfg, 2, cuda=False), lambda: check_cuda_graphs(cfg, "cpu")):
        with pytest.raises(UserError, match=r'^train.compile = "reduce-overhead" captures CUDA graphs, but the workers '
                                            r"train on the CPU .*; use train.compile = true$"):
            refused()
    on_cpu = load_config(None, ["train.compile=reduce-overhead", "parallel.device=cpu"])
    with pytest.raises(UserError, match="captures CUDA graphs, but the workers train on the CPU"):
        resolve_layout(on_cpu, 1, cuda=True)
    check_cuda_graphs(load_config(None, ["train.compile=max-autotune-no-cudagraphs"]), "cpu")

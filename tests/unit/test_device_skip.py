"""The optimizer step as the step runs it (parallel/precision.py): fused where torch allows, equal to the
foreach step it replaced within a stated tolerance, and a bad step skipped, by the device itself (a GPU's
route, taken here on the CPU) or by the host (the CPU's), leaving the weights, the optimizer's state and
its step count as they were."""

import pytest
import torch

from shoal.config import TrainConfig
from shoal.parallel.precision import Precision, takes_found_inf
from shoal.training.optim import fusable, optimizer_groups


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def verdict(bad: float, route: str) -> torch.Tensor | float:
    """The verdict as the step hands it: a device scalar ("device": the fused optimizer skips, as on a GPU) or a
    number ("host": the CPU's host decided)."""
    return torch.tensor(bad) if route == "device" else bad


def train(optimizer_name: str, fused: bool, steps: int = 20, bad_at: tuple[int, ...] = (),
          route: str = "device") -> torch.nn.Module:
    """`steps` AdamW (or SGD) steps of a small model on fixed data through Precision.step; at the steps in
    `bad_at` the verdict says bad."""
    m = model()
    cfg = TrainConfig(optimizer=optimizer_name, momentum=0.9, lr=1e-2)
    cls, groups, hyper = optimizer_groups(m.parameters(), cfg)
    hyper = {k: v for k, v in hyper.items() if k != "fused"}
    opt = cls(groups, **hyper, **({"fused": True} if fused else {"foreach": True}))
    precision = Precision("fp32", torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        precision.step(opt, skip=verdict(float(step in bad_at), route))
        opt.zero_grad(set_to_none=True)
    return m


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_the_fused_step_equals_the_foreach_step(optimizer_name):
    fused, foreach = train(optimizer_name, fused=True), train(optimizer_name, fused=False)
    for a, b in zip(fused.parameters(), foreach.parameters(), strict=True):
        # the fused kernel rounds its arithmetic in another order: fp32, 20 steps of lr 1e-2, measured at most
        # 1.9e-7 (AdamW) and 5.8e-8 (SGD) of the largest weight apart
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused, route", [(True, "device"), (True, "host"), (False, "device")],
                         ids=["fused, the device decides", "fused, the host decides", "foreach (the host decides)"])
def test_a_bad_step_changes_nothing(fused, route):
    # a skipped step is as if its batch never came: compare with a run that never had it
    skipped, shorter = train("adamw", fused, steps=6, bad_at=(3,), route=route), None
    m = model()
    cls, groups, hyper = optimizer_groups(m.parameters(), TrainConfig(lr=1e-2))
    opt = cls(groups, **hyper)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step == 3:
            continue
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    shorter = m
    for a, b in zip(skipped.parameters(), shorter.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ["device", "host"])
def test_a_skipped_step_leaves_the_step_count(route):
    m = model()
    cls, groups, hyper = optimizer_groups(m.parameters(), TrainConfig())
    opt = cls(groups, **hyper)
    assert takes_found_inf(opt) and fusable(list(m.parameters()))
    precision = Precision("fp32", torch.device("cpu"))
    m(torch.randn(2, 16)).sum().backward()
    precision.step(opt, skip=verdict(0.0, route))
    before = [p.detach().clone() for p in m.parameters()]
    precision.step(opt, skip=verdict(1.0, route))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert {float(s["step"]) for s in opt.state.values()} == {1.0}  # AdamW's bias correction stays in step

"""The bad-step verdict (training/bad_steps.py) and the flags the host reads of it (training/flags.py): on the
device, in float32 as a fused optimizer takes it (and on the CPU's host, the same), from values that are the same
on every rank."""

import math

import pytest
import torch

from shoal.training.bad_steps import BadStepPolicy
from shoal.training.flags import agreed_flags

INF, NAN = math.inf, math.nan


def verdict(loss: float, norms: float, scaled: bool = False) -> torch.Tensor:
    """The device's verdict; the host's (the CPU's route) must say the same."""
    policy = BadStepPolicy("skip", 3, scaled=scaled)
    values = torch.tensor(loss, dtype=torch.float64), torch.tensor(norms, dtype=torch.float64)
    on_device, on_host = policy.verdict(*values), policy.verdict(*values, on_host=True)
    assert isinstance(on_host, float) and on_host == on_device.item()
    return on_device


@pytest.mark.parametrize(("loss", "norms", "bad"), [
    (2.5, 0.7, 0.0), (0.0, 0.0, 0.0), (-3.0, 1e30, 0.0),  # finite, however large
    (NAN, 0.7, 1.0), (INF, 0.7, 1.0), (-INF, 0.7, 1.0),  # the loss
    (2.5, NAN, 1.0), (2.5, INF, 1.0),  # a gradient norm (world size 1: the norm; else NaN from some rank)
    (INF, -INF, 1.0), (NAN, NAN, 1.0),
])
def test_the_verdict_is_whether_loss_and_norms_are_finite(loss, norms, bad):
    out = verdict(loss, norms)
    assert out.dtype == torch.float32 and out.shape == () and out.item() == bad


def test_under_loss_scaling_only_the_loss_counts():
    # fp16: an overflowing gradient is the scaler's to skip, not a bad step
    assert verdict(2.5, INF, scaled=True).item() == 0.0
    assert verdict(NAN, 0.7, scaled=True).item() == 1.0


def test_the_host_reads_a_bad_norm_from_either_world_size():
    host = {"loss_sum": 3.0, "stops": 0.0, "save": 0.0, "regroup": 0.0, "stop_age": 0.0}
    assert agreed_flags({**host, "bad_norms": NAN}).bad_norm  # summed over ranks: NaN where one was bad
    assert not agreed_flags({**host, "bad_norms": 0.0}).bad_norm
    assert agreed_flags({**host, "grad_norm": INF}).bad_norm  # world size 1: the norm itself
    assert not agreed_flags({**host, "grad_norm": 1.5}).bad_norm

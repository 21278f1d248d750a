"""metrics/host_syncs.py's counter: per step, on the training thread only, where each read was made, and
nothing left behind once closed; on a GPU through torch's sync debug mode warnings (here a fake CUDA: the
mode's setter and the warnings it would raise)."""

import sys
import threading
import warnings

import pytest
import torch

from shoal.metrics.host_syncs import SYNC_WARNING, HostSyncs

HERE = "tests/unit/test_host_syncs.py"


def in_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_the_cpu_counts_value_reads_of_the_training_thread_by_step_and_place():
    step = [1]
    syncs = HostSyncs(torch.device("cpu"), lambda: step[0]).open()
    try:
        x = torch.ones(3)
        x.sum().item()
        float(x[0])
        in_thread(lambda: x.sum().item())  # the data thread's reads are the host's own
        step[0] = 2
        bool(x[1] > 0)
        x.add_(1)  # no read
    finally:
        syncs.close()
    x.sum().item()  # closed: not counted
    assert syncs.take(1) == 2 and syncs.take(2) == 1 and syncs.take(3) == 0
    assert sum(syncs.sites.values()) == 3 and len(syncs.sites) == 3 and all(HERE in site for site in syncs.sites)


def test_a_sync_not_reported_yet_goes_to_the_next_step_s_line():
    step = [1]
    syncs = HostSyncs(torch.device("cpu"), lambda: step[0]).open()
    try:
        step[0] = 2
        torch.ones(1).item()
        step[0] = 1  # a step's hooks after its line (the phase has not moved on): charged, not lost
        torch.ones(1).item()
    finally:
        syncs.close()
    assert syncs.take(1) == 1 and syncs.take(2) == 1


class FakeCuda:
    """torch.cuda's sync debug mode as a CUDA build has it: the setter and the getter."""

    def __init__(self, monkeypatch):
        self.mode = 0
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode",
                            lambda m: setattr(self, "mode", {"default": 0, "warn": 1, "error": 2}.get(m, m)))


def test_a_gpu_counts_torch_s_sync_warnings_of_the_training_thread_and_shows_the_rest(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    syncs = HostSyncs(torch.device("cuda"), lambda: 3).open()
    try:
        assert cuda.mode == 1
        for _ in range(2):  # the same place twice: each counted (not once per place)
            warnings.warn(f"{SYNC_WARNING} (.item())", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        in_thread(lambda: warnings.warn(f"{SYNC_WARNING} (a checkpoint's copy)", UserWarning, stacklevel=1))
    finally:
        syncs.close()
    assert syncs.take(3) == 2 and list(syncs.sites.values()) == [2]
    assert shown == ["something else", f"{SYNC_WARNING} (a checkpoint's copy)"]
    assert cuda.mode == 0
    warnings.warn(f"{SYNC_WARNING} (after close)", UserWarning, stacklevel=1)
    assert syncs.take(3) == 0 and shown[-1] == f"{SYNC_WARNING} (after close)"


def test_a_sync_warned_inside_torch_is_charged_to_the_code_outside_it(monkeypatch):
    FakeCuda(monkeypatch)
    inside = {}  # a function whose file is in torch, as a collective's wrapper is: the warning names its line
    exec(compile("import warnings\ndef op(message):\n    warnings.warn(message, UserWarning, stacklevel=1)\n",
                 "/site-packages/torch/distributed/fake.py", "exec"), inside)
    syncs = HostSyncs(torch.device("cuda"), lambda: 1).open()
    try:
        line = sys._getframe().f_lineno + 1
        inside["op"](f"{SYNC_WARNING} (a collective)")
    finally:
        syncs.close()
    assert len(syncs.sites) == 1 and next(iter(syncs.sites)).endswith(f"{HERE}:{line}")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_closing_twice_is_closing_once(monkeypatch, device):
    FakeCuda(monkeypatch)
    syncs = HostSyncs(torch.device(device), lambda: 1).open()
    syncs.close()
    syncs.close()
    torch.ones(1).item()
    assert syncs.take(1) == 0

"""Timing the waits of torch's own collectives inside the model (comm/model_waits.py): the private torch
names it wraps still exist, a wrapped wait is charged to its axis, FSDP2's all-gather is logged and its
wait timed, and a pipeline's waits count as bubble first (metrics/profile.py)."""

import pytest
import torch

from shoal.comm.log import CollectiveLog
from shoal.comm.model_waits import LoggedAllGather, _state, _timed
from shoal.metrics.profile import step_breakdown


def test_the_wrapped_torch_names_exist():
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import schedules

    assert callable(funcol.wait_tensor) and callable(schedules._wait_batch_p2p)
    assert hasattr(FSDPModule, "set_custom_all_gather")


def test_a_wrapped_wait_is_charged_to_its_axis(monkeypatch):
    log = CollectiveLog()
    monkeypatch.setitem(_state, "log", log)
    wait = _timed(lambda: torch.ones(256, 256).sum(), lambda: "tp")
    wait()
    assert log.exposed["tp"] > 0
    with log.blocked_in({"group": "dp"}):  # inside one of shoal's own waits: counted there, not twice
        before = dict(log.exposed)
        wait()
        assert log.exposed == before


def test_fsdp_all_gather_is_logged_and_its_wait_timed():
    from shoal import dist

    dist.init("gloo", 30)
    try:
        log = CollectiveLog()
        out, shard = torch.zeros(4), torch.arange(4.0)
        work = LoggedAllGather(log, "blocks.0")(out, shard, torch.distributed.group.WORLD, async_op=True)
        assert isinstance(work, torch.distributed.distributed_c10d.Work)  # what FSDP2 checks
        rec = log.last()
        assert rec["group"] == "dp, parameters of blocks.0" and not rec["done"]
        work.wait()
        assert log.last()["done"] and "dp" in log.exposed and torch.equal(out, shard)
        assert work.wait()  # FSDP2 may wait twice: the second is free and counts nothing more
    finally:
        dist.shutdown()


def test_pipeline_waits_are_bubble_first():
    phases = {"forward_backward_s": 0.30, "optimizer_s": 0.02}
    # 0.30 s of forward/backward, 0.10 of it waiting for the neighbour stage; the schedule's bubble is 0.2
    m = step_breakdown(phases, {"forward_backward_s": {"pp": 0.10}}, ("pp",), 0.2)
    assert m["time_bubble_s"] == pytest.approx(0.06)
    assert m["time_exposed_pp_s"] == pytest.approx(0.04) and m["time_compute_s"] == pytest.approx(0.20)
    assert sum(m.values()) == pytest.approx(0.32)
    # waits shorter than the bubble: no exposed pp, the bubble is the schedule's share still
    m = step_breakdown(phases, {"forward_backward_s": {"pp": 0.01}}, ("pp",), 0.2)
    assert m["time_exposed_pp_s"] == 0 and m["time_bubble_s"] == pytest.approx(0.06)
    assert sum(m.values()) == pytest.approx(0.32)

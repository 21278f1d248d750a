"""What a logged step records on the host, made cheap: the model state's bytes walked again only when the walk
would find other tensors (metrics/memory.py), and the heartbeat rewritten in place (rundir.py)."""

import json
import os

import torch

from shoal.metrics.memory import StateBytes, model_state_bytes
from shoal.rundir import Heartbeat, read_json


def test_state_bytes_follow_the_state_as_it_appears_and_goes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured = StateBytes()
    before = measured(model, opt)
    assert before == model_state_bytes(model, opt) and before["grads"] == 0 and before["optimizer"] == 0
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    after = measured(model, opt)  # gradients and the optimizer's state now exist: walked again
    assert after == model_state_bytes(model, opt) and after["grads"] == after["params"] > 0
    assert after["optimizer"] == 2 * after["params"] + 4 * 4  # two fp32 moments, a step count per tensor
    assert measured(model, opt) is after  # nothing changed in number: the same figures, not walked again
    opt.zero_grad(set_to_none=True)
    assert measured(model, opt)["grads"] == 0


def test_the_heartbeat_is_one_json_record_whatever_was_there(tmp_path):
    path = tmp_path / "progress.json"
    path.write_text(json.dumps({"step": 123456789, "time": 1.5, "world": 64, "from": "the attempt before"}))
    beat = Heartbeat(path)
    assert read_json(path)["step"] == 123456789  # not truncated before this attempt's first write
    for step in (10, 20, 30):
        beat.write({"step": step, "time": 2.5, "world": 1})
        assert read_json(path) == {"step": step, "time": 2.5, "world": 1}  # shorter: padded, still valid
    beat.write({"step": 40, "time": 2.5, "world": 1, "note": "x" * 500})  # longer: the file grows
    assert read_json(path)["step"] == 40
    beat.write({"step": 50})
    assert read_json(path) == {"step": 50} and os.path.getsize(path) > 500
    beat.close()

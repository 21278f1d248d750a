"""shoal.Session hands a user's loop its batches on the device the model trains on, as Accelerate's
prepared loader does: every tensor default_collate makes, in tuples, lists, dicts and named tuples."""

from collections import namedtuple

import torch

from shoal.training.session_data import on_device

Pair = namedtuple("Pair", "x y")


def test_every_tensor_of_a_collated_batch_moves_and_the_rest_stays():
    meta = torch.device("meta")  # a device other than the CPU that this machine has
    batch = torch.utils.data.default_collate([(torch.ones(2), {"y": torch.zeros(1), "name": "a"}, 3)] * 4)
    moved = on_device(batch, meta)
    assert isinstance(moved, list) and moved[0].device == meta and moved[0].shape == (4, 2)
    assert moved[1]["y"].device == meta and moved[1]["name"] == ["a"] * 4
    assert moved[2].device == meta  # default_collate made the ints a tensor
    pair = on_device(Pair(torch.ones(3), (torch.ones(1), "keep")), meta)
    assert isinstance(pair, Pair) and pair.x.device == meta and pair.y[0].device == meta and pair.y[1] == "keep"

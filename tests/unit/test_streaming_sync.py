"""Streaming DiLoCo's pieces on one replica (no process group: a single replica averages nothing, the
outer step and the merge still run): the fragments, their staggered steps, a delayed round's merge,
and a round in flight across a checkpoint."""

import pytest
import torch

from shoal.comm.codecs import Codec
from shoal.config import load_config
from shoal.errors import UserError
from shoal.parallel.fragments import block_of, split_fragments, sync_offset
from shoal.parallel.local_sgd import PeriodicSync

GPT_NAMES = ["tok_emb.weight", "pos_emb.weight", *[f"blocks.{i}.{p}" for i in range(4) for p in ("w", "b")],
             "ln_f.weight", "head.weight"]


def test_fragments_are_consecutive_blocks_and_the_rest_goes_with_the_first():
    assert block_of(["model.layers.0.q", "model.layers.1.q", "model.norm.w", "x.0.y"])[0] == "model.layers"
    parts = split_fragments(GPT_NAMES, 2)
    assert [[GPT_NAMES[i] for i in p] for p in parts] == [
        ["tok_emb.weight", "pos_emb.weight", "blocks.0.w", "blocks.0.b", "blocks.1.w", "blocks.1.b",
         "ln_f.weight", "head.weight"],
        ["blocks.2.w", "blocks.2.b", "blocks.3.w", "blocks.3.b"]]
    assert split_fragments(GPT_NAMES, 1) == [list(range(len(GPT_NAMES)))]
    with pytest.raises(UserError, match=r"sync.fragments = 3 must divide the model's blocks.*4 blocks"):
        split_fragments(GPT_NAMES, 3)
    with pytest.raises(UserError, match="no repeated blocks"):
        split_fragments(["a.weight", "b.weight"], 2)


def test_fragments_synchronise_at_staggered_steps():
    assert [sync_offset(f, 1, 8) for f in range(1)] == [0]  # one fragment: every 8th step, as DiLoCo
    assert [sync_offset(f, 4, 8) for f in range(4)] == [2, 4, 6, 0]
    assert [sync_offset(f, 3, 8) for f in range(3)] == [2, 5, 0]


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.zeros(2))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(2))


def walk(model, step):
    """A replica's inner step: every parameter moves by -1 (its pseudo-gradient grows by 1 a step)."""
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)


def test_a_delayed_round_lands_later_merged_with_the_replica_s_progress():
    """local SGD, H = 4, 2 fragments (emb + block 0, block 1), delay 1, alpha 0.5. Fragment 0 sends at
    step 2 (pseudo-gradient 2), lands after step 3: anchor 0 - 2 = -2, params 0.5 x (-3) + 0.5 x (-2)."""
    model = Toy()
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    sync = PeriodicSync("local-sgd", 4, Codec(None), last_step=100, fragments=2, delay=1, alpha=0.5)
    sync.attach(model, None, 1)
    for step in (1, 2):
        walk(model, step)
        sync.after_step(step)
    assert len(sync.in_flight) == 1 and sync.in_flight[0].due == 3
    assert model.emb.tolist() == [-2.0, -2.0]  # not applied yet: training goes on
    walk(model, 3)
    sync.after_step(3)
    assert model.emb.tolist() == [-2.5, -2.5] and model.blocks[0].weight.item() == -2.5
    assert model.blocks[1].weight.item() == -3.0  # fragment 1 is still on its own
    assert sync.anchor[0].tolist() == [-2.0, -2.0] and not sync.in_flight
    walk(model, 4)
    sync.after_step(4)  # fragment 1 sends its 4 steps; lands after step 5
    assert sync.in_flight[0].fragments == [1] and not sync.in_sync(4)


def test_the_last_step_lands_everything_and_ends_with_one_model():
    model = Toy()
    sync = PeriodicSync("diloco", 4, Codec(None), outer_lr=0.7, outer_momentum=0.9, last_step=5, fragments=2,
                        delay=2)
    sync.attach(model, None, 1)
    for step in range(1, 6):
        walk(model, step)
        sync.after_step(step)
    assert not sync.in_flight and sync.in_sync(5)
    for p, a in zip(sync.params, sync.anchor, strict=True):
        assert torch.equal(p, a)


def test_one_fragment_without_delay_is_diloco():
    """The streaming code with P = 1, tau = 0 takes the same steps as DiLoCo's one round (hand-computed:
    outer SGD, lr 0.5, no momentum: anchor 0 - 0.5 x 3 = -1.5 after step 3)."""
    model = Toy()
    sync = PeriodicSync("diloco", 3, Codec(None), outer_lr=0.5, last_step=100)
    sync.attach(model, None, 1)
    for step in (1, 2, 3):
        walk(model, step)
        sync.after_step(step)
    assert model.emb.tolist() == [-1.5, -1.5] and sync.in_sync(3) and not sync.in_sync(2)


def test_a_round_in_flight_survives_a_checkpoint():
    model = Toy()
    sync = PeriodicSync("diloco", 4, Codec(None), outer_lr=0.7, outer_momentum=0.9, last_step=100, fragments=2,
                        delay=2)
    sync.attach(model, None, 1)
    for step in (1, 2, 3):  # fragment 0 sent at step 2, due after step 4
        walk(model, step)
        sync.after_step(step)
    state, tensors = sync.state_dict(), {k: v.clone() for k, v in sync.rank_state().items()}
    assert state["in_flight"] == [{"fragments": [0], "sent": 2, "due": 4}]
    restored = Toy()
    restored.load_state_dict(model.state_dict())
    again = PeriodicSync("diloco", 4, Codec(None), outer_lr=0.7, outer_momentum=0.9, last_step=100, fragments=2,
                         delay=2)
    again.attach(restored, None, 1)
    again.load_state_dict(state)
    again.load_rank_state(tensors)
    for step in (4, 5, 6, 7):
        for m, s in ((model, sync), (restored, again)):
            walk(m, step)
            s.after_step(step)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(again.in_flight) == len(sync.in_flight) == 1


@pytest.mark.parametrize("sets,message", [
    (["sync.fragments=2"], 'stream the synchronisation of sync.mode = "local-sgd" or "diloco"'),
    (['sync.mode="diloco"', "sync.every=4", "sync.fragments=3"], r"must divide the model's blocks \(model.n_layer = 4\)"),
    (['sync.mode="diloco"', "sync.every=4", "sync.fragment_delay=4"], "set fragment_delay < every"),
    (['sync.mode="diloco"', "sync.every=4", "sync.fragment_delay=1", 'comm.compression="powersgd"'],
     'use "int8", "int4", "fp16", "bf16" or "topk", or fragment_delay = 0'),
])
def test_bad_streaming_settings_are_one_line(sets, message):
    with pytest.raises(UserError, match=message) as err:
        load_config("configs/gpt-tiny.toml", ["model.n_layer=4", *sets])
    assert "\n" not in str(err.value)


def test_warm_up_steps_average_without_the_outer_step():
    """sync.warmup_steps = 2: steps 1 and 2 set the anchor to the replicas' mean (one replica: its own
    parameters) and leave the outer momentum untouched; the rounds of H = 2 start after."""
    model = Toy()
    sync = PeriodicSync("diloco", 2, Codec(None), outer_lr=0.5, outer_momentum=0.9, last_step=100, warmup=2)
    sync.attach(model, None, 1)
    for step in (1, 2):
        walk(model, step)
        sync.after_step(step)
        assert torch.equal(sync.anchor[0], model.emb.detach()) and sync.in_sync(step)
    assert not sync.outer[0].state  # no outer step yet
    for step in (3, 4):
        walk(model, step)
        sync.after_step(step)
    # the first outer step: pseudo-gradient 2 (anchor -2, replica -4); Nesterov's first step is lr x (1 + 0.9) x 2
    torch.testing.assert_close(model.emb.detach(), torch.full((2,), -2 - 0.5 * 1.9 * 2))


def test_a_round_in_flight_needs_the_same_fragments_to_resume():
    model = Toy()
    sync = PeriodicSync("local-sgd", 4, Codec(None), last_step=100, fragments=2, delay=2)
    sync.attach(model, None, 1)
    for step in (1, 2):
        walk(model, step)
        sync.after_step(step)
    state, tensors = sync.state_dict(), sync.rank_state()
    other = PeriodicSync("local-sgd", 4, Codec(None), last_step=100, fragments=1, delay=2)
    other.attach(Toy(), None, 1)
    other.load_state_dict(state)
    with pytest.raises(UserError, match="resume with the sync.fragments it was saved with"):
        other.load_rank_state(tensors)

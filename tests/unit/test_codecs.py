"""The codecs' encode/decode and error-feedback bookkeeping on known tensors (no process group: the
collectives are checked in tests/dist/test_sync_modes.py)."""

import pytest
import torch

from shoal.comm.codecs import Int4, Int8, PowerSGD, TopK, make_codec, ring_bytes


def test_int8_round_trip_is_within_half_a_step():
    x = torch.tensor([0.0, 1.0, -2.54, 0.3, 2.54])
    codec = Int8(comm=None)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == 4 + 5  # one fp32 scale, one byte per entry
    scale = 2.54 / 127
    y = codec.decode(payload, 5)
    assert (y - x).abs().max() <= scale / 2 + 1e-7
    assert y[4] == pytest.approx(2.54) and y[2] == pytest.approx(-2.54) and y[0] == 0


def test_int8_decodes_a_payload_at_any_byte_of_a_gathered_buffer():
    """Payloads of 4 + 5 bytes side by side, as all-gathered: the second starts at byte 9 (measured before
    the fix: a float32 view there raised "storage_offset must be divisible by 4")."""
    codec = Int8(comm=None)
    a, b = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]), torch.tensor([0.1, 0.2, -0.3, 0.4, -0.5])
    every = torch.cat([codec.encode(a), codec.encode(b)])
    torch.testing.assert_close(codec.decode(every[9:], 5), codec.decode(codec.encode(b), 5))
    torch.testing.assert_close(codec.decode(every[9:], 5), b, rtol=0, atol=0.5 / 127 / 2)  # half a step of int8


def test_int8_of_zeros_is_zeros():
    codec = Int8(comm=None)
    assert codec.decode(codec.encode(torch.zeros(7)), 7).eq(0).all()


def test_int4_round_trip_is_within_half_a_step_of_each_block():
    """130 entries: blocks of 64, 64 and 2 (padded), each with its own scale; one outlier (100.0) coarsens
    only its own block."""
    x = torch.linspace(-1, 1, 130)
    x[70] = 100.0
    codec = Int4(comm=None)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == 3 * 4 + 3 * 32  # a scale and 32 bytes per block
    y = codec.decode(payload, 130)
    assert y.shape == (130,) and y[70] == pytest.approx(100.0)
    for block in range(3):
        part = slice(64 * block, 64 * (block + 1))
        assert (y[part] - x[part]).abs().max() <= x[part].abs().max() / 7 / 2 + 1e-6
    assert (y[:64] - x[:64]).abs().max() <= 1 / 7 / 2 + 1e-6  # untouched by block 1's outlier
    assert codec.decode(codec.encode(torch.zeros(5)), 5).eq(0).all()


def test_int4_decodes_every_level_and_a_payload_at_any_byte():
    levels = torch.arange(-7.0, 8.0)  # the 15 levels with scale 1: exact
    codec = Int4(comm=None)
    torch.testing.assert_close(codec.decode(codec.encode(levels), 15), levels, rtol=0, atol=1e-6)
    every = torch.cat([codec.encode(torch.ones(3)), codec.encode(levels)])  # the second starts at byte 36
    torch.testing.assert_close(codec.decode(every[36:], 15), levels, rtol=0, atol=1e-6)


def test_topk_keeps_the_largest_magnitudes_and_their_places():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05])
    codec = TopK(comm=None, ratio=0.25)  # ceil(0.25 x 8) = 2 entries
    payload = codec.encode(x)
    assert payload.numel() == 2 * 4 + 2 * 4  # fp32 values and int32 indices
    assert codec.decode(payload, 8).tolist() == [0, -5.0, 0, 3.0, 0, 0, 0, 0]
    assert codec.k(3) == 1 and codec.k(1000) == 250


def test_error_feedback_keeps_what_was_dropped_and_adds_it_next_time():
    codec = TopK(comm=None, ratio=0.25)
    g = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05])
    x = codec._fed("w", g)
    sent = codec.decode(codec.encode(x), 8)
    codec._keep("w", x, sent)
    assert torch.equal(codec.residuals["w"], g - sent)  # everything not sent
    # next step: the residual joins the new gradient, so 1.0 (dropped before) now makes the top 2
    x2 = codec._fed("w", torch.zeros(8))
    assert torch.equal(x2, g - sent)
    assert codec.decode(codec.encode(x2), 8).nonzero().flatten().tolist() == [4, 6]
    # over steps, nothing is lost: what was sent plus what is kept is everything that came in
    sent2 = codec.decode(codec.encode(x2), 8)
    codec._keep("w", x2, sent2)
    assert torch.allclose(sent + sent2 + codec.residuals["w"], g)


def test_error_feedback_off_keeps_nothing():
    codec = Int8(comm=None, error_feedback=False)
    x = codec._fed("w", torch.tensor([0.011, 1.0]))
    codec._keep("w", x, codec.decode(codec.encode(x), 2))
    assert codec.residuals == {}


def test_lossless_codecs_have_no_error_feedback():
    assert make_codec("int4", comm=None).feedback
    for name in ("none", "fp16", "bf16"):
        codec = make_codec(name, comm=None)
        assert not codec.feedback and codec.name == name


def test_powersgd_compresses_only_matrices_it_makes_smaller():
    codec = PowerSGD(comm=None, rank=4)
    assert codec.shape(torch.zeros(64)) is None  # vectors: sent as they are
    assert codec.shape(torch.zeros(6, 6)) is None  # (6 + 6) x 4 > 36: no saving
    assert codec.shape(torch.zeros(64, 32)) == (64, 32, 4)
    assert codec.shape(torch.zeros(8, 4, 4)) == (8, 16, 4)  # conv kernels: n x (everything else)


def test_powersgd_state_round_trips():
    codec = PowerSGD(comm=None, rank=2)
    codec.q["w"], codec.residuals["w"] = torch.randn(5, 2), torch.randn(10)
    other = PowerSGD(comm=None, rank=2)
    other.load_state_tensors(codec.state_tensors())
    assert torch.equal(other.q["w"], codec.q["w"]) and torch.equal(other.residuals["w"], codec.residuals["w"])


def test_merged_residuals_keep_the_mean_update_s_dropped_part_on_any_world():
    """Three ranks' residuals merged for a new world: every rank gets their mean, so the new world's mean
    residual (what the all-reduced update still owes) is the old one, whatever its size."""
    old = [{"residual/w": torch.tensor([3.0, -6.0])}, {"residual/w": torch.tensor([0.0, 3.0])},
           {"residual/w": torch.tensor([1.5, 0.0])}]
    merged = Int8.merge_state_tensors(old, world=3)
    assert merged["residual/w"].tolist() == [1.5, -1.0]
    for new_world in (1, 2, 4):
        assert torch.equal(sum([merged["residual/w"]] * new_world) / new_world, sum(s["residual/w"] for s in old) / 3)
    # a rank that was lost counts as zero: its part of what the update owes is lost with it
    assert Int8.merge_state_tensors(old[:2], world=3)["residual/w"].tolist() == [1.0, -1.0]
    assert old[0]["residual/w"].tolist() == [3.0, -6.0]  # the inputs are left as they were


def test_merged_powersgd_state_keeps_q_which_every_rank_shares():
    q = torch.randn(5, 2)
    old = [{"residual/w": torch.ones(10), "q/w": q}, {"residual/w": torch.zeros(10), "q/w": q.clone()}]
    merged = PowerSGD.merge_state_tensors(old, world=2)
    assert torch.equal(merged["q/w"], q) and merged["residual/w"].eq(0.5).all()


def test_every_step_holds_the_codec_state_of_the_last_completed_step():
    """A step's backward replaces residuals bucket by bucket: what a checkpoint or a live run's snapshot
    takes (rank_state) is the state at the last completed step, and a skipped step's changes are undone."""
    from shoal.parallel.sync import EveryStep

    sync = EveryStep(Int8(comm=None))
    x = sync.codec._fed("w", torch.tensor([0.011, 1.0]))
    sync.codec._keep("w", x, sync.codec.decode(sync.codec.encode(x), 2))
    assert sync.rank_state() == {}  # no step has completed
    sync.after_step(1)
    done = sync.codec.residuals["w"]
    assert torch.equal(sync.rank_state()["residual/w"], done)
    x = sync.codec._fed("w", torch.tensor([0.5, -0.013]))  # the next step, midway: its residual is new
    sync.codec._keep("w", x, sync.codec.decode(sync.codec.encode(x), 2))
    assert not torch.equal(sync.codec.residuals["w"], done)
    assert torch.equal(sync.rank_state()["residual/w"], done)
    sync.skipped()  # the step was bad: the next one starts from the last completed step's residuals
    assert torch.equal(sync.codec.residuals["w"], done)


def test_ring_bytes():
    n = 1000
    assert ring_bytes("all_reduce", n, 2) == n  # 2 (w - 1) / w
    assert ring_bytes("all_reduce", n, 4) == 1500
    assert ring_bytes("all_gather", n, 4) == 3000
    assert ring_bytes("reduce_scatter", n, 2) == 500
    assert ring_bytes("all_reduce", n, 1) == 0

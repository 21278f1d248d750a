"""Context parallelism's split and its refusals (parallel/context.py, layout.py, preflight.py): the head-tail chunks
cover each sequence once and balance the causal work; what cp cannot split is refused in one line, before any worker
starts."""

import pytest
import torch

from shoal.config import load_config
from shoal.errors import UserError
from shoal.layout import resolve_layout
from shoal.parallel.context import head_tail

GPT = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000"]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_head_tail_chunks_cover_the_sequence_once_and_balance_the_causal_work(cp):
    parts = [head_tail(32, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(32))
    assert torch.equal(parts[0][:32 // (2 * cp)], torch.arange(32 // (2 * cp)))
    work = {int((p + 1).sum()) for p in parts}  # keys a rank's queries attend to under the causal mask
    assert len(work) == 1, work


def test_a_batch_is_cut_to_the_rank_s_positions():
    from shoal.parallel.context import ContextParallel

    batch = {"input": torch.arange(16).repeat(2, 1), "target": torch.arange(1, 17).repeat(2, 1)}
    mine = ContextParallel(None, None, 2, 1).shard(batch)
    assert mine["positions"].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert mine["input"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11] and mine["target"][1, 0] == 5


@pytest.mark.parametrize(("sets", "world", "says"), [
    (["parallel.cp=2", "model.seq_len=30"], 2, "model.seq_len = 30 is not a multiple of 4"),
    (["parallel.cp=4"], 2, "parallel.cp (4) must divide the data-parallel ranks (dp 2)"),
    (["parallel.cp=2", "model.dropout=0.1"], 2, "model.dropout = 0.1 drops attention weights"),
    (["parallel.cp=2", 'model.name="moe"', "model.experts=4", "parallel.ep=2"], 2,
     "parallel.cp = 2 with parallel.ep is not built yet"),
    (["parallel.cp=2", 'sync.mode="local-sgd"', "sync.every=4"], 2,
     'parallel.cp = 2 with sync.mode = "local-sgd" is not built yet'),
    (["parallel.cp=2", 'model.name="resnet"', 'data.source="synthetic-images"'], 2,
     'model.name = "resnet" trains on no sequences'),
])
def test_what_cp_cannot_split_is_refused_in_one_line(sets, world, says):
    base = [] if 'model.name="resnet"' in sets else GPT
    with pytest.raises(UserError) as e:
        resolve_layout(load_config(None, [*base, *sets]), world, cuda=False)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_model_that_takes_no_positions_is_refused_before_any_worker_starts():
    from shoal.preflight import check_job

    cfg = load_config(None, [*GPT, 'model.name="moe"', "model.experts=4", "parallel.cp=2"])
    with pytest.raises(UserError, match='which model.name = "moe" is not built for'):
        check_job(cfg, [2], cuda=False)


def test_a_forward_that_never_calls_scaled_dot_product_attention_is_refused():
    """transformers' "eager" attention computes the scores itself: under cp it would attend within the rank's own
    chunks, so the forward is refused when it ends."""
    from shoal.parallel.context import ContextParallel

    with pytest.raises(UserError, match=r'parallel.cp = 2 replaces .*"eager".*set parallel.cp = 1'):
        with ContextParallel(None, None, 2, 0).attention({}):
            torch.ones(2) * 2

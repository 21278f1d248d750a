"""Context parallelism's attention (parallel/context.py) against one process: each rank holding its head-tail chunks
of a sequence's queries, keys and values, attention over the group's gathered keys and values gives its positions
what causal attention over the whole sequence gives them, and the gradients of its queries, keys and values are
the whole sequence's at its positions (fp32: within 1e-5 of the largest value), on 2 and 4 ranks, with the CPU's
fused kernel and with the plain-ops blocks other devices use, with grouped-query attention (fewer key heads), and
over packed documents (data.pack_documents: attention inside each document, against one process's document mask).
Runs in the in-process harness."""

import pytest


def split_against_whole(env, heads: int, key_heads: int, seq_len: int, plain_blocks: bool, packed: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from shoal.comm.collectives import Comm
    from shoal.data.packing import document_positions
    from shoal.models.documents import visible
    from shoal.parallel import context
    from shoal.parallel.context import ContextParallel, head_tail

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq_len, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, key_heads, seq_len, 8, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(2, heads, seq_len, 8, generator=g)
    gqa = {"enable_gqa": True} if key_heads != heads else {}
    # packed: documents of 1 to 12 tokens, so that a rank's chunks hold whole documents, cut ones, and queries
    # that see no key of an earlier chunk
    ends = torch.randint(1, 13, (2, seq_len), generator=g).cumsum(1) - 1
    tokens = torch.zeros(2, seq_len, dtype=torch.long).scatter_(1, ends.clamp(max=seq_len - 1), 1)
    positions = document_positions(tokens, 1)
    index = torch.arange(seq_len)
    mask = {"attn_mask": visible(index, positions, index)} if packed else {"is_causal": True}
    whole = F.scaled_dot_product_attention(q, k, v, **mask, **gqa)
    (whole * w).sum().backward()

    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("cp",))
    cp = ContextParallel(Comm(env.store, env.rank, env.world_size), mesh.get_group(), env.world_size, env.rank)
    pos = head_tail(seq_len, env.world_size, env.rank)
    mine = [t.detach()[:, :, pos].requires_grad_() for t in (q, k, v)]
    fused = context.FUSED
    context.FUSED = frozenset() if plain_blocks else fused  # the blocks other devices compute, here on the CPU
    try:
        with cp.attention({"positions": positions[:, pos]} if packed else {}):
            out = F.scaled_dot_product_attention(*mine, is_causal=True, **gqa)
        (out * w[:, :, pos]).sum().backward()
    finally:
        context.FUSED = fused  # the worker processes persist

    def rel(ours, theirs) -> float:
        return ((ours - theirs).abs().max() / theirs.abs().max()).item()

    gathered = sorted({r["op"] for r in cp.comm.log.records if r["group"] == "cp"})
    return {"out": rel(out, whole[:, :, pos]), "q": rel(mine[0].grad, q.grad[:, :, pos]),
            "k": rel(mine[1].grad, k.grad[:, :, pos]), "v": rel(mine[2].grad, v.grad[:, :, pos]), "ops": gathered}


@pytest.mark.parametrize(("world", "heads", "key_heads", "plain", "packed"), [
    (2, 2, 2, False, False),
    pytest.param(4, 4, 2, False, False, marks=pytest.mark.slow),
    pytest.param(2, 2, 2, True, False, marks=pytest.mark.slow),
    (2, 2, 2, False, True),
    pytest.param(4, 4, 2, True, True, marks=pytest.mark.slow),
], ids=["cp2", "cp4-gqa", "cp2-plain-blocks", "cp2-packed", "cp4-packed-plain-blocks"])
def test_each_rank_s_positions_get_what_attention_over_the_whole_sequence_gives(ranks, world, heads, key_heads, plain,
                                                                                packed):
    for rank, diffs in enumerate(ranks(world).run(split_against_whole, heads, key_heads, 32, plain, packed)):
        assert all(diffs[k] < 1e-5 for k in ("out", "q", "k", "v")), (rank, diffs)
        assert diffs["ops"] == ["all_gather", "reduce_scatter"], (rank, diffs)  # under the "cp" label

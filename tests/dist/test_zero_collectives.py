"""ZeRO 2/3's collectives on gloo, in the in-process harness (tests/harness.py): the reduce-scatter by
all-to-all equals gloo's reduce_scatter_tensor (bitwise for two ranks, within rounding for three), two
ranks' swap of shards equals gloo's all-gather, and FSDP2's all-gather outputs and reduce-scatter
inputs borrow one buffer (comm/lent_buffer.py), each back only once its collective is done."""

import pytest
import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def reduce_scatters(env):
    from shoal.comm.collectives import Comm
    from shoal.compat import reduce_scatter_single

    comm = Comm(env.store, env.rank, env.world_size)
    g = torch.Generator().manual_seed(env.rank)
    results = []
    for dtype in (torch.float32, torch.bfloat16) if env.world_size == 2 else (torch.float32,):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            x = torch.randn(env.world_size * 1000, generator=g).to(dtype)
            ours, glo = torch.empty(1000, dtype=dtype), torch.empty(1000, dtype=dtype)
            comm.reduce_scatter(ours, x, op=op, label="dp, test")
            reduce_scatter_single(glo, x, op=op)
            results.append((str(dtype), str(op), torch.equal(ours, glo), (ours - glo).abs().max().item()))
    return results, all(r["done"] for r in comm.log.records)


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_by_all_to_all_matches_gloo(ranks, world):
    for results, done in ranks(world).run(reduce_scatters):
        assert done
        for dtype, op, equal, diff in results:
            assert equal if world == 2 else diff < 1e-6, (dtype, op, diff)  # a + b either way; 3 ranks: order


def gathers(env):
    from shoal.comm.collectives import all_gather_pair
    from shoal.compat import all_gather_single

    shard = torch.randn(1000, generator=torch.Generator().manual_seed(10 + env.rank))
    gloo = torch.empty(2000)
    all_gather_single(gloo, shard)
    apart = torch.zeros(2000)
    all_gather_pair(apart, shard, None).wait()
    in_place = torch.zeros(2000)
    mine = in_place[env.rank * 1000:(env.rank + 1) * 1000]
    mine.copy_(shard)
    all_gather_pair(in_place, mine, None).wait()  # FSDP2's input is this rank's part of the output
    return torch.equal(apart, gloo), torch.equal(in_place, gloo)


def test_two_ranks_swapping_shards_all_gather_as_gloo_does(ranks):
    assert ranks(2).run(gathers) == [(True, True)] * 2


def lent_buffers(env):
    from shoal.comm.codecs import Codec
    from shoal.comm.collectives import Comm
    from shoal.comm.lent_buffer import LentBuffer
    from shoal.comm.log import CollectiveLog
    from shoal.comm.model_waits import LoggedAllGather
    from shoal.parallel.sync import CodecReduceScatter

    buf, world = LentBuffer(), dist.group.WORLD
    gather = LoggedAllGather(CollectiveLog(), "blocks.0", buf)
    out = gather.allocate((8,), dtype=torch.float32, device=CPU)
    mine = out[env.rank * 4:(env.rank + 1) * 4]
    mine.fill_(env.rank + 1.0)
    work = gather(out, mine, world, async_op=False)  # lent: handed back as a Work even when asked to wait
    lent, out_until_waited = buf.holds(out), buf.lend((8,), torch.float32, CPU) is None
    work.wait()  # FSDP2 waits right before it copies the output out
    gathered = out.tolist()

    reduce = CodecReduceScatter(Codec(Comm(env.store, env.rank, 2)), "blocks.0", buf)
    results = []
    for _ in range(2):  # the first call teaches it the sizes; until then the input is its own
        flat = reduce.allocate((8,), dtype=torch.float32, device=CPU)  # FSDP2 asks for the input first
        shard = reduce.allocate((4,), dtype=torch.float32, device=CPU)  # the output is never lent
        flat.copy_(torch.arange(8.0) * (env.rank + 1))
        probe = buf.lend((4,), torch.float32, CPU)
        held = buf.holds(flat), buf.holds(shard), probe is None
        if probe is not None:
            buf.give_back()
        reduce(shard, flat, world, dist.ReduceOp.AVG)
        results.append((held, shard.tolist()))
    back = buf.lend((4,), torch.float32, CPU) is not None
    return lent, out_until_waited, gathered, results, back


def test_collective_buffers_are_lent_one_at_a_time(ranks):
    for rank, (lent, out_until_waited, gathered, results, back) in enumerate(ranks(2).run(lent_buffers)):
        assert lent and out_until_waited
        assert gathered == [1.0] * 4 + [2.0] * 4
        mean = [1.5 * x for x in range(4 * rank, 4 * rank + 4)]  # chunk `rank` of (1x + 2x) / 2
        assert results == [((False, False, False), mean), ((True, False, True), mean)]
        assert back  # the reduce-scatter gave its input back once reduced

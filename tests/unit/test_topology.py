import pytest

from shoal.errors import UserError
from shoal.topology import ParallelDims


def test_auto_dp_fills_the_world():
    d = ParallelDims.resolve("auto", 1, 1, 4)
    assert (d.dp, d.tp, d.pp) == (4, 1, 1)


def test_mismatch_names_every_factor_and_the_fix():
    with pytest.raises(UserError) as e:
        ParallelDims.resolve(3, 2, 1, 4)
    assert str(e.value) == ("parallel.dp (3) x parallel.tp (2) x parallel.pp (1) = 6, but 4 processes were "
                            "started; set --nproc 6 or change the degrees")


def test_auto_needs_divisible_world():
    with pytest.raises(UserError, match="does not divide the 3 processes"):
        ParallelDims.resolve("auto", 2, 1, 3)


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (4, 1, 2), (1, 4, 2), (8, 1, 1)])
def test_coords_and_rank_of_are_inverse(dp, tp, pp):
    d = ParallelDims.resolve(dp, tp, pp, dp * tp * pp)
    assert [d.rank_of(**d.coords(r)) for r in range(d.world_size)] == list(range(d.world_size))


def test_groups_partition_the_world_and_tp_is_innermost():
    d = ParallelDims.resolve(2, 2, 2, 8)
    assert d.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis in ("dp", "tp", "pp"):
        assert sorted(r for g in d.group_ranks(axis) for r in g) == list(range(8))


def test_device_mesh_has_named_axes():
    from shoal import dist

    env = dist.init("gloo", timeout_s=30)
    try:
        mesh = ParallelDims.resolve("auto", 1, 1, env.world_size).device_mesh("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "tp") and mesh["dp"].size() == 1
    finally:
        dist.shutdown()

"""ParallelDims: the rank grid of a run, validated up front, with the DeviceMesh built on first use.

Ranks are laid out row-major over mesh axes ("pp", "dp", "tp"): tp varies fastest so tensor-parallel
peers are neighbours (same node, fastest links), pp slowest. Everything but `mesh` is pure arithmetic
and testable without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import UserError

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard, the shard groups of consecutive dp ranks

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @classmethod
    def resolve(cls, dp: int | str, tp: int, pp: int, world_size: int, dp_replicate: int = 1) -> ParallelDims:
        """Fill in dp = "auto" and validate dp x tp x pp == world_size (and that dp_replicate divides dp)."""
        if world_size < 1:
            raise UserError(f"world size must be >= 1, got {world_size}")
        if dp == "auto":
            if world_size % (tp * pp):
                raise UserError(
                    f"parallel.tp ({tp}) x parallel.pp ({pp}) = {tp * pp} does not divide the {world_size} "
                    f"processes started; set --nproc to a multiple of {tp * pp} or change the degrees"
                )
            dp = world_size // (tp * pp)
        if dp * tp * pp != world_size:
            raise UserError(
                f"parallel.dp ({dp}) x parallel.tp ({tp}) x parallel.pp ({pp}) = {dp * tp * pp}, but "
                f"{world_size} processes were started; set --nproc {dp * tp * pp} or change the degrees"
            )
        if dp % dp_replicate:
            raise UserError(f"parallel.dp_replicate ({dp_replicate}) must divide dp ({dp}): replicas of equal "
                            f"shard groups; set it to a divisor of {dp} (the nodes of the job, typically)")
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size, dp_replicate=dp_replicate)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Position of `rank` on each axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, axis: str) -> list[list[int]]:
        """The rank groups that communicate along `axis` (e.g. each dp group for gradient all-reduce)."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; axes are {AXES}")
        others = [a for a in AXES if a != axis]
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            groups.setdefault(tuple(c[a] for a in others), []).append(r)
        return list(groups.values())

    def device_mesh(self, device_type: str):
        """A new DeviceMesh over all ranks with named axes; needs an initialized process group. Not cached
        here: a mesh keeps the process groups it made alive, so it must not outlive the group it was made
        from (a live run forms a new group after each membership change, with the same dims)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)

    def shard_mesh(self, mesh):
        """The mesh ZeRO 2/3 shards over: `mesh`'s dp axis, or under HSDP (dp_replicate > 1) that axis split
        into (dp_replicate, dp_shard), FSDP2's 2-D mesh (replicated over the first, sharded over the second)."""
        if self.dp_replicate == 1:
            return mesh["dp"]
        from shoal.compat import split_mesh_axis

        return split_mesh_axis(mesh, "dp", (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard"))


def local_part(t):
    """The part of a tensor this rank holds: a DTensor's local shard, any other tensor itself; either as the
    plain tensor that holds its values where a wrapper subclass holds them (torchao's float8 weight under
    float8 all-gather wraps the fp32 shard, and a wrapper has no storage of its own to read)."""
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(t, DTensor) or not hasattr(t, "__tensor_flatten__"):
        return t
    names, _ = t.__tensor_flatten__()  # torch's protocol for wrapper subclasses: the tensors inside
    return next((getattr(t, n) for n in names if getattr(t, n).shape == t.shape), t)

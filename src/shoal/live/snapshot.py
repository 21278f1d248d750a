"""A rank's state held in memory across a change of the group: a Snapshot, taken at a step boundary
(capture) and put back (restore), with what the group does with them at a change: the lowest rank holding
the newest step sends its Snapshot to the ranks that hold an older one or none (heal, one_replica), and
every rank's own tensors are merged for the new world (pooled). A Snapshot holds the live tensors, not a
copy (copied() makes one): the generation that took it has ended, and its state goes on from there.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from shoal.checkpoint.tensors import apply_tensor_state, tensor_state
from shoal.live.transfer import DTYPES, broadcast_state


@dataclass
class Snapshot:
    """A rank's whole state at a step boundary: `tensors` by name (model/, optim/ and this rank's own
    rank/ tensors such as error-feedback residuals), `meta` the JSON rest (the checkpoint's shared parts,
    the optimizer's plain values, the RNG streams, and the rank and world it was taken at)."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict


def capture(state, step: int, config_toml: str, data_spec: dict, rank: int, world: int) -> Snapshot:
    """`state` (checkpoint.train_state.TrainState) at `step`, holding its live tensors."""
    ts = tensor_state(state.model, state.optimizer)
    tensors = {f"model/{k}": v for k, v in ts["model"].items() if isinstance(v, torch.Tensor)}
    values = {}
    for k, v in ts.get("optim", {}).items():
        if isinstance(v, torch.Tensor):
            tensors[f"optim/{k}"] = v
        else:
            values[k] = list(v) if isinstance(v, tuple) else v
    # a rank's own replica (local SGD, DiLoCo) is already under model/ and optim/
    tensors.update({f"rank/{k}": v for k, v in state.rank_tensors().items() if not k.startswith(("model/", "optim/"))})
    meta = {"shared": state.capture(step, config_toml, data_spec), "optim_values": values,
            "rng": state.rng.state_dict(), "rank": rank, "world": world}
    return Snapshot(step, tensors, meta)


def restore(state, snapshot: Snapshot, rank: int, world: int, seed: int, own: bool) -> bool:
    """Put `snapshot` into `state`'s live parts. `own`: it is this rank's own (not a peer's); its RNG
    streams are kept only then and on the same rank and world, as a resume on another world size does,
    and so are its rank tensors unless they were merged for any rank (pooled()). Returns whether the RNG
    streams are the snapshot's."""
    t, m = snapshot.tensors, snapshot.meta
    model = {k.removeprefix("model/"): v for k, v in t.items() if k.startswith("model/")}
    optim = {**{k.removeprefix("optim/"): v for k, v in t.items() if k.startswith("optim/")},
             **{k: tuple(v) if k.endswith(".betas") else v for k, v in m["optim_values"].items()}}
    apply_tensor_state(state.model, state.optimizer, {"model": model, "optim": optim})
    same = own and m["rank"] == rank and m["world"] == world
    mine = rank_tensors(snapshot) if same or m.get("pooled") else None
    return state.load(m["shared"], mine, m["rng"] if same else None, rank, seed, where="a peer's state")


def rank_tensors(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    return {k.removeprefix("rank/"): v for k, v in snapshot.tensors.items() if k.startswith("rank/")}


def pooled(comm, state, snapshot: Snapshot, gives: bool, device: torch.device) -> Snapshot:
    """Collective: `snapshot` with its rank tensors (error-feedback residuals) replaced by what every rank of
    any world goes on with: state.merge_rank_tensors over the ranks that give theirs (`gives`), in rank
    order, for the world they were taken at. Called at a planned change over the old group, where every
    rank gives, so a member that leaves takes nothing with it; and at the start of every generation, where
    a failure's survivors give theirs (the lost member's are lost) and ranks that hold a merge already or a
    peer's state give none. When no rank gives, `snapshot` as it is. `device`: the rank's, where every
    tensor handed to the group is made (NCCL takes nothing else)."""
    mine = rank_tensors(snapshot) if gives else {}
    have = torch.tensor([int(bool(mine)), snapshot.meta["world"]], dtype=torch.int64, device=device)
    every = comm.all_gather_flat(have, label="world, regroup: who gives rank tensors").view(-1, 2).tolist()
    givers = [r for r, (gave, _) in enumerate(every) if gave]
    if not givers:
        return snapshot
    first, world = givers[0], every[givers[0]][1]
    spec = {"keys": [[k, str(v.dtype), list(v.shape)] for k, v in mine.items()]} if comm.rank == first else None
    _, spec = broadcast_state(comm, first, {} if comm.rank == first else None, spec, device)
    merged: dict[str, torch.Tensor] = {}
    for key, dtype, shape in spec["keys"]:  # one tensor at a time: world x its size in memory, not the model's
        t = mine[key].contiguous() if mine else torch.zeros(shape, dtype=DTYPES[dtype], device=device)
        rows = comm.all_gather(t, label=f"world, regroup: rank tensor {key}")
        merged.update(state.merge_rank_tensors([{key: rows[r]} for r in givers], world))
    kept = {k: v for k, v in snapshot.tensors.items() if not k.startswith("rank/")}
    return Snapshot(snapshot.step, {**kept, **{f"rank/{k}": v for k, v in merged.items()}},
                    {**snapshot.meta, "pooled": True})


def heal(comm, held: Snapshot | None, device: torch.device, from_one: bool = False
         ) -> tuple[Snapshot | None, int | None]:
    """Collective, at the start of a new generation: the state each rank goes on from, and the rank it
    was healed from (None: its own). The ranks say which step they hold; when they differ (a joiner
    holds none; a survivor may have missed the update its peers applied just before the failure), the
    lowest rank holding the newest step sends its Snapshot to all. `from_one` (replicas that differ
    between synchronisations: local SGD, DiLoCo): it sends it whatever the others hold, and every
    replica goes on from its model and inner optimizer state, as a resume on another world size goes on
    from rank 0's (unless every rank holds one replica already: one_replica()); a rank that held the same
    step keeps its own rank tensors and RNG streams. (None, None): no rank holds any, as when every member
    was lost: the run resumes from its newest checkpoint. `device`: the rank's, where what it hands the group
    is made (NCCL takes nothing else); a state received stays there (transfer.py)."""
    mine = torch.tensor([held.step if held is not None else -1, int(held is not None and held.meta.get("one", False))],
                        dtype=torch.int64, device=device)
    every = comm.all_gather_flat(mine, label="world, heal: the step each rank holds").view(-1, 2).tolist()
    steps = [s for s, _ in every]
    best = max(steps)
    if best < 0:
        return None, None
    if all(s == best for s in steps) and (not from_one or all(one for _, one in every)):
        return held, None
    src = steps.index(best)
    sending = comm.rank == src
    tensors, meta = broadcast_state(comm, src, held.tensors if sending else None,
                                    {**held.meta, "step": held.step} if sending else None, device)
    if sending:
        return held, src
    step = meta.pop("step")
    if held is not None and held.step == best:  # the peer's replica, this rank's own rank tensors
        kept = {k: v for k, v in tensors.items() if not k.startswith("rank/")}
        return Snapshot(step, {**kept, **{f"rank/{k}": v for k, v in rank_tensors(held).items()}},
                        {**meta, "rank": held.meta["rank"], "world": held.meta["world"], "rng": held.meta["rng"],
                         "own": held.meta.get("own", True), "pooled": held.meta.get("pooled", False)}), src
    return Snapshot(step, tensors, {**meta, "own": False}), src


def one_replica(comm, snapshot: Snapshot, device: torch.device) -> Snapshot:
    """Collective over the old group at a planned change where replicas differ (local SGD, DiLoCo: at a
    round's end they are one model, but each inner optimizer's state is its own): every member takes rank
    0's replica while rank 0 is still in the group, even when rank 0 is the member that leaves, so that the
    run goes on as a resume from disk on the new world size does (from rank 0's file). After a failure the
    survivors can only go on from the lowest survivor's (heal(from_one)); marked, so that the next
    generation does not send it again."""
    got, _ = heal(comm, snapshot, device, from_one=True)
    return Snapshot(got.step, got.tensors, {**got.meta, "one": True})


def copied(snapshot: Snapshot | None) -> Snapshot | None:
    """A Snapshot that stays as it is while training goes on (its tensors cloned, its meta deep-copied)."""
    if snapshot is None:
        return None
    return Snapshot(snapshot.step, {k: v.detach().clone() for k, v in snapshot.tensors.items()},
                    copy.deepcopy(snapshot.meta))

"""A live elastic run's answers at training's hook points (training/generation.py): one generation of the
group, trained from what this rank holds, ended by a change of the group.

When a member dies, the survivors' collective fails, or sooner a layer of their step does once a
connection of the group has closed (connections.ConnectionWatch); when one leaves or a joiner waits, the
step's flags say so and every rank stops at the same step boundary. Either way the rank's state at its last
completed step (sampler.step: the optimizer has applied exactly that many updates; a peer's failure
surfaces only in a collective or a layer of the forward/backward, and neither runs between the update
and the step count) is captured as a Snapshot (snapshot.py), not copied (its tensors are the live ones),
and raised in Regroup out of the training code, so that nothing holds the broken process group any more
and destroying it closes its connections (which is what unblocks a survivor still waiting on a peer that
has already given up: gloo does not notice otherwise until its timeout). The worker then forms the next
generation (generations.py) and runs the same training again from the Snapshot: built without
initialising, restored in memory, or healed from a peer's Snapshot over the new group (transfer.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from shoal.live.connections import ConnectionWatch, open_sockets
from shoal.live.snapshot import Snapshot, capture, copied, one_replica, pooled, restore
from shoal.training.generation import Generation


class Regroup(Exception):  # noqa: N818 - not an error: the group changes
    """The current generation of the group ends; `snapshot` is the state this rank goes on from (its last
    step's; a round's start where replicas differ; None: from the newest checkpoint, or the start)."""

    def __init__(self, snapshot: Snapshot | None, why: str):
        super().__init__(why)
        self.snapshot, self.why = snapshot, why


def peer_failed(e: BaseException) -> bool:
    """A collective failed because a peer went away (its connection closed or reset, or gloo timed out
    waiting for it), as opposed to this rank's own error."""
    text = str(e)
    return isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
        "gloo/transport", "connectFullMesh"))


@dataclass
class LiveGeneration(Generation):
    """A rank's part in one generation of a live run, handed to run_training."""

    held: Snapshot | None  # the state to go on from (None: fresh, or from a checkpoint)
    regroup_wanted: Callable[[], bool]  # this rank asks the group to change at the step's end
    events: list[dict] = field(default_factory=list)  # the changes of the group so far, for the summary
    record: object = None  # the loop's Record, kept across generations (training/loop.py)
    started: float = 0.0  # perf_counter when this process began training
    opened: set = field(default_factory=set)  # the sockets open before this generation (open_sockets)
    # replicas that differ between synchronisations: a copy of the state at the last step where they were
    # one model, to go back to when a peer fails mid-round (its round's work cannot be recovered)
    round: Snapshot | None = None
    # the worker froze its start-up heap, and collects each ended generation itself (generations.py)
    freezes_heap = False

    def holds_state(self) -> bool:
        return self.held is not None

    def restore(self, run) -> None:
        """Collective: the held Snapshot into the run; a failure's survivors first merge their own tensors
        (error-feedback residuals) for the new world (a planned change merged them already: regroup)."""
        env, held = run.env, self.held
        snap = pooled(run.comm, run.state, held, gives=held.meta.get("own", True) and not held.meta.get("pooled"),
                      device=env.device)
        restore(run.state, snap, env.rank, env.world_size, run.cfg.train.seed, own=snap.meta.get("own", True))

    def begin(self, run, trainer) -> None:
        """The loop's record goes on across generations; where replicas differ, a copy of the state is kept at
        each synchronisation; a new generation's first line says what changed."""
        if run.state.replicas_differ:
            self.hold_rounds(run, trainer.hooks)
        if self.record is not None:  # the history of the generations before this one
            trainer.record = self.record
        self.record = trainer.record
        if self.events:
            event = self.events[-1]
            trainer.sinks.print(event["line"])
            trainer.sinks.event({"step": run.sampler.step, "time": event["time"], "membership": event["line"],
                                 "world": event["world"]})

    @contextlib.contextmanager
    def watching(self, phase):
        """Within it, a connection this generation opened that closes ends the step at its next layer
        (`phase`'s hooks raise connections.PeerLost): the survivors of a peer that died mid-step stop computing
        a step that can no longer complete, rather than finish its forward and backward first."""
        watch = ConnectionWatch(open_sockets() - self.opened)
        phase.check = watch.check
        try:
            yield
        finally:
            watch.close()
            phase.check = lambda: None

    def regroup(self, run) -> Regroup:
        """Collective over the old group at a planned change: the state this rank goes on from. Every member
        gives its own tensors to the merge while the group still holds them all; where replicas differ, rank 0
        hands its replica to the others, even when rank 0 is the member that leaves (snapshot.one_replica)."""
        held = pooled(run.comm, run.state, snapshot(run), gives=True, device=run.env.device)
        if run.state.replicas_differ:
            held = one_replica(run.comm, held, run.env.device)
        return Regroup(held, "the group changes: a member leaves or a joiner waits")

    def lost(self, run, error: BaseException) -> BaseException | None:
        if isinstance(error, Regroup):  # at a step boundary: a member leaves, or a joiner waits
            return error
        if not peer_failed(error):
            return None
        return Regroup(self.held_after_failure(run), f"a peer failed ({str(error).splitlines()[0][:160]})")

    def summarize(self, summary: dict) -> None:
        summary["membership"] = self.events

    def held_after_failure(self, run) -> Snapshot | None:
        """The state a survivor goes on from when a peer failed inside a step. Replicas that differ go back to
        where they were one model: the round's work died with the peer. Else the state at the last step this
        rank completed; where a collective after the update failed (a logged step's memory figures are
        gathered then), the weights, the optimizer and the schedule are at that step's end on every survivor
        (each took it once their flags were agreed), so that step counts as done, not the one before."""
        if run.state.replicas_differ:
            return self.round
        run.sampler.step = max(run.sampler.step, run.step.updated)
        return snapshot(run)

    def hold_rounds(self, run, hooks) -> None:
        """Keep a copy of this rank's state wherever the replicas are one model (the start, if they are, and
        each synchronisation): where replicas that differ go back to when a peer fails. None (the start, or a
        resume that began mid-round): back to the newest checkpoint, or the start."""
        self.round = copied(snapshot(run)) if run.step.par.in_sync(run.sampler.step) else None

        def keep(m: dict, last: bool, by_time: bool) -> None:
            if run.step.par.in_sync(m["step"]):
                self.round = copied(snapshot(run))

        hooks.after_step.append(keep)


def snapshot(run) -> Snapshot | None:
    """This rank's state at its last completed step; None before its first: nothing is learned yet, and
    DCP's state dict of an optimizer that has not stepped would initialise its state by a step of lr 0,
    which AdamW counts (its bias correction is then one step off)."""
    step = run.sampler.step
    if step == 0:
        return None
    return capture(run.state, step, run.cfg.to_toml(), dataclasses.asdict(run.source.spec), run.env.rank,
                   run.env.world_size)

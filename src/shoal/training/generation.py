"""The hook points through which a run's membership reaches training (train.py asks them, in this order):

    started          when this process began training (None: as the Run is built)
    holds_state      whether the run goes on from state held in memory rather than a checkpoint
    restore          that state put into the Run (only when it holds some)
    regroup_wanted   asked at each step's end: should the group change now (the step's flags carry it)
    freezes_heap     whether the loop's collector freezes the heap after the first steps
    begin            the loop's Trainer is ready: hooks of its own, what it says first
    watching         around the loop: what stops a step whose group is broken
    regroup          the ranks agreed to change the group at a step's end: the exception the run ends with
    lost             a failure inside the loop: the exception the run ends with instead (None: the failure)
    summarize        summary.json's membership fields

A run of fixed membership (this class) is one generation of its group: it starts from its newest checkpoint
or from scratch and ends with the run; a failure ends it, and a restart (launch/restart.py) begins it again.
A live elastic run (shoal/live/) trains one generation after another in the same process and answers each
point from what its members hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable


class Generation:
    """The only generation of a run whose members stay fixed."""

    started: float | None = None
    regroup_wanted: Callable[[], bool] | None = None
    freezes_heap = True

    def holds_state(self) -> bool:
        return False

    def restore(self, run) -> None:
        """Nothing to put back: a fixed group holds no state in memory (it restores from a checkpoint)."""

    def begin(self, run, trainer) -> None:
        pass

    def watching(self, phase):
        return contextlib.nullcontext()

    def regroup(self, run) -> BaseException:
        # unreachable by design: with regroup_wanted None the step's flags never ask for a change
        raise RuntimeError("the ranks agreed to change a fixed group: its regroup_wanted is None, so no step asks")

    def lost(self, run, error: BaseException) -> BaseException | None:
        return None

    def summarize(self, summary: dict) -> None:
        pass

"""The random generators a recorded build draws from (models/deferred.py), and the states the build sets
them to: a `torch.manual_seed(...)` in a constructor, a private `torch.Generator` seeded there, a state put
back with `torch.set_rng_state`.

Nothing is drawn while a build is recorded (its tensors are on the meta device), so a generator's state
changes during the record only when the build sets it. Before each draw, and when the build ends, every
generator the build uses is compared with the state it was last seen in; a change is logged as an operation
that sets that state, so that the replay, which does draw, sets it at the same point as one process did.

One case cannot be followed: a build that reads a generator's state and puts it back later
(`torch.random.fork_rng`, `get_rng_state` then `set_rng_state`). In one process the state read had
advanced by every draw before it; in the record it had not, and the value put back is the unadvanced one.
It shows as a generator set back to a state it was in before, with draws made from it in between; a
seed set again to the same value looks the same. Both are refused (Unrecordable): the model is built
whole instead (training/build.py), never with other values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Unrecordable(Exception):
    """The build does something its record cannot replay exactly; the message says what, in a phrase."""


@dataclass
class _Epoch:
    """A stretch of the build in which a generator kept one state (as the record sees it)."""

    state: torch.Tensor
    drew: bool = False


@dataclass
class _Seen:
    generator: torch.Generator
    epochs: list[_Epoch] = field(default_factory=list)


def set_state(generator: torch.Generator, state: torch.Tensor) -> None:
    """A logged operation: the build set `generator` to `state` here."""
    generator.set_state(state)


class Generators:
    """The generators a build draws from. `log(generator, state)` appends a set_state operation to the
    record. The default CPU generator's first state is the record's own (`start`), which a replay sets first."""

    def __init__(self, log, start: torch.Tensor):
        self._log = log
        # by the generator itself (its _cdata): an operation's generator argument is a new Python object
        self._seen: dict[int, _Seen] = {}
        default = torch.default_generator
        self._seen[default._cdata] = _Seen(default, [_Epoch(start)])

    def before_draw(self, generator: torch.Generator | None) -> None:
        """A random operation is about to be logged: it draws from `generator` (None: the default one)."""
        generator = generator or torch.default_generator
        if generator.device.type != "cpu":
            raise Unrecordable(f"it draws from a generator on {generator.device}, and shoal builds on the CPU")
        self._follow(generator).epochs[-1].drew = True

    def finish(self) -> None:
        """The build has ended: the state it left each generator in, logged where it set one."""
        for seen in list(self._seen.values()):
            self._follow(seen.generator)

    def _follow(self, generator: torch.Generator) -> _Seen:
        seen = self._seen.get(generator._cdata)
        state = generator.get_state()
        if seen is None:  # a private generator, first drawn from: the state it is in
            seen = self._seen[generator._cdata] = _Seen(generator)
        elif torch.equal(state, seen.epochs[-1].state):
            return seen
        elif any(e.drew and torch.equal(state, e.state) for e in seen.epochs):
            raise Unrecordable("it sets a random generator back to a state it had drawn from (torch.random.fork_rng, "
                               "get_rng_state then set_rng_state, or the same seed twice), whose value in one "
                               "process the record cannot know")
        seen.epochs.append(_Epoch(state))
        self._log(generator, state)
        return seen

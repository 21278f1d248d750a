"""Synchronising the dp replicas every H steps instead of every step: local SGD and DiLoCo.

Each dp rank holds a whole replica (tensor and pipeline parallelism may split it further over its own
tp and pp ranks) with no data-parallel wrapper, so a step sends no gradients: each replica's
optimizer (the inner one) steps on the gradient of its own slice of the global batch. Every
`sync_every` steps:

  delta_i = anchor - params_i          the replica's pseudo-gradient since the last sync
  delta   = mean over replicas         through the codec (comm.compression applies to it)
  local-sgd: anchor <- anchor - delta  (the average of the replicas' parameters)
  diloco:    anchor <- outer SGD step on `anchor` with gradient `delta` (Nesterov momentum; Douillard
             et al. 2023: outer lr 0.7, momentum 0.9, inner AdamW)
  params_i <- anchor

`anchor` is the parameters at the last sync, identical on every replica. The last step always syncs,
so the run ends with one model (final weights, final validation); a validation between syncs
averages what each replica scores on its share of the batch. Between syncs the replicas
differ, and so do their inner optimizers' states: the checkpoint keeps each rank's parameters and
optimizer state in its own file (TrainState, replicas_differ), and the anchor, the outer momentum and
the codec's residuals through rank_state(); a killed run resumes bitwise. Resumed on another world
size, every replica starts from the checkpoint's model and inner optimizer state (rank 0's replica),
with the anchor and the outer momentum as saved and the codec's residuals merged (merge_rank_states);
from a checkpoint of another sync mode, the model becomes the anchor. A live run changes its group only
where the replicas are one model (in_sync), and after a failure goes back to the round's start; every
replica then goes on from one replica's inner state (rank 0's at a planned change, as from disk; the
lowest survivor's after a failure: live/snapshot.py).

With H = 1, outer lr 1 and no momentum both equal every-step data parallelism for an optimizer that
is linear in the gradient (SGD, with or without momentum): the mean of the replicas' updates is the
update of the mean gradient. AdamW is not linear, so they differ (tests/dist/test_sync_modes.py).

Streaming (sync.fragments P > 1, sync.fragment_delay tau > 0; Douillard et al. 2025): the parameters
are split into P fragments of consecutive blocks (parallel/fragments.py), fragment p synchronised at
its own step of each round (staggered by H / P), so one all-reduce at a time carries 1/P of the model.
With tau > 0 a fragment's pseudo-gradient is sent asynchronously at its step and applied tau steps
later, the replicas training on meanwhile; the new anchor is then merged with the replica's progress:
params_i <- alpha params_i + (1 - alpha) anchor (the paper's alpha 0.5). Rounds in flight at a
checkpoint are waited for and their averaged pseudo-gradients saved with the rank's state, so a
resumed run applies them at the same step (bitwise). With P = 1 and tau = 0 this is the DiLoCo above,
the same operations in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.comm.codecs import Codec, Round
from shoal.comm.log import CollectiveLog
from shoal.errors import UserError
from shoal.parallel.fragments import split_fragments, sync_offset
from shoal.parallel.sync import EveryStep
from shoal.topology import local_part as local

OWN = ("anchor/", "momentum/", "in_flight/")  # this sync's own tensors in a rank's state; the rest is the codec's


@dataclass
class InFlight:
    """Fragments' synchronisation sent at step `sent` and applied after step `due`."""

    fragments: list[int]
    indices: list[int]  # their parameters' positions
    sent: int
    due: int
    deltas: list[torch.Tensor]
    round: Round | None  # None once waited for (the deltas then hold the mean), or with one replica
    outer: bool = True  # DiLoCo's outer step; False: the replicas' mean (a warm-up step)

    def mean(self) -> list[torch.Tensor]:
        if self.round is not None:
            self.round.wait()
            self.round = None
        return self.deltas


class PeriodicSync:
    verdict_at_once = True  # a sync is due only after steps that ran

    def __init__(self, mode: str, every: int, codec: Codec, outer_lr: float = 1.0, outer_momentum: float = 0.0,
                 last_step: int = 0, inner: EveryStep | None = None, fragments: int = 1, delay: int = 0,
                 alpha: float = 0.5, warmup: int = 0):
        if mode not in ("local-sgd", "diloco"):
            raise ValueError(f"unknown periodic sync {mode!r}")
        self.name, self.every, self.codec = mode, every, codec
        self.last_step = last_step  # synchronised whatever H, so that the run ends with one model
        # a replica of several ranks synchronises its gradients every step among them (the wrapper's)
        self.inner = inner or EveryStep(Codec(codec.comm))
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.fragments, self.delay, self.alpha = fragments, delay, alpha
        self.warmup = warmup  # steps 1..warmup average the replicas' parameters at every step, no outer step
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.anchor: list[torch.Tensor] = []
        self.parts: list[list[int]] = []  # each fragment's parameter positions
        self.outer: list[torch.optim.SGD] = []  # DiLoCo: one outer optimizer per fragment
        self.in_flight: list[InFlight] = []
        self._saved_flights: list[dict] = []  # a checkpoint's rounds in flight, until their tensors are loaded
        self.group, self.replicas = None, 1  # the dp group (None: the default group) and its size
        self.syncs = 0
        self.synced = 0  # the last step where every fragment was synced and none in flight (0: the start)

    def attach(self, model: torch.nn.Module, dp_group, dp: int) -> None:
        """This rank's whole model (all its stages), after wrapping; the anchor is its parameters now."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.parts = split_fragments(self.names, self.fragments)
        self.group, self.replicas = dp_group, dp
        self._reset_anchor()

    @torch.no_grad()
    def _reset_anchor(self) -> None:
        self.anchor = [local(p).detach().float().clone() for p in self.params]
        self.in_flight = []
        self.outer = []
        if self.name == "diloco":
            self.outer = [torch.optim.SGD([self.anchor[i] for i in part], lr=self.outer_lr,
                                          momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
                          for part in self.parts]

    def install(self, module: torch.nn.Module, dp_group, log: CollectiveLog) -> None:
        self.inner.install(module, dp_group, log)  # only for a replica of several ranks

    def reduces(self, index: int, count: int) -> bool:
        return self.inner.reduces(index, count)  # without a wrapper, nothing to reduce whatever it says

    def after_backward(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        every = list(range(len(self.parts)))
        if step <= self.warmup:  # (nothing is in flight: rounds start after the warm-up)
            self._sync(every, step, delay=0, outer=False)
            return
        while self.in_flight and self.in_flight[0].due <= step:  # due now (or at a step skipped as bad)
            self._apply(self.in_flight.pop(0))
        if step == self.last_step:  # the run ends with one model: what is in flight lands, then all sync
            while self.in_flight:
                self._apply(self.in_flight.pop(0))
            self._sync(every, step, delay=0)
            return
        due = [f for f in every if step % self.every == sync_offset(f, len(every), self.every)]
        if due:
            self._sync(due, step, self.delay)

    def in_sync(self, step: int) -> bool:
        return step == self.synced  # not at a step skipped as bad where a sync was due: it did not run

    def skipped(self) -> None:
        pass  # its codec runs only in a sync, after a step that was not skipped

    @torch.no_grad()
    def _sync(self, fragments: list[int], step: int, delay: int, outer: bool = True) -> None:
        """Send these fragments' pseudo-gradients (one round: their tensors in one collective); apply it
        now, or after step `step + delay`; `outer` False: the anchor becomes the replicas' mean (a warm-up
        step, the outer optimizer left untouched)."""
        idx = [i for f in fragments for i in self.parts[f]]
        deltas = [self.anchor[i] - local(self.params[i]).float() for i in idx]
        rnd = None
        if self.replicas > 1:  # a single replica has nothing to average (the outer step still runs)
            rnd = self.codec.start(deltas, [self.names[i] for i in idx], self.group,
                                   f"dp, {self.name} pseudo-gradient")
        flight = InFlight(fragments, idx, step, step + delay, deltas, rnd, outer)
        if delay:
            self.in_flight.append(flight)
        else:
            self._apply(flight)
            if len(fragments) == len(self.parts) and not self.in_flight:
                self.synced = step  # every fragment synchronised, nothing in flight: the replicas are one model
        self.syncs += 1

    @torch.no_grad()
    def _apply(self, flight: InFlight) -> None:
        """The outer step on the fragments' anchor with the averaged pseudo-gradient, and the replica set to
        it; a delayed round's anchor is merged with what the replica learned since it was sent."""
        deltas = flight.mean()
        anchors = [self.anchor[i] for i in flight.indices]
        if not self.outer or not flight.outer:
            for a, d in zip(anchors, deltas, strict=True):
                a.sub_(d)
        else:
            for a, d in zip(anchors, deltas, strict=True):
                a.grad = d
            for f in flight.fragments:
                self.outer[f].step()
                self.outer[f].zero_grad(set_to_none=True)
        for i, a in zip(flight.indices, anchors, strict=True):
            x = local(self.params[i])
            if flight.due > flight.sent:
                x.mul_(self.alpha).add_(a, alpha=1 - self.alpha)
            else:
                x.copy_(a)

    # --- checkpointed state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        flights = [{"fragments": f.fragments, "sent": f.sent, "due": f.due} for f in self.in_flight]
        return {"syncs": self.syncs, "synced": self.synced, **({"in_flight": flights} if flights else {})}

    def load_state_dict(self, state: dict) -> None:
        self.syncs, self.synced = int(state.get("syncs", 0)), int(state.get("synced", 0))
        self._saved_flights = list(state.get("in_flight", []))  # their tensors come with load_rank_state

    def _momentum(self, i: int) -> dict:
        """The outer optimizer's state of parameter i (DiLoCo)."""
        f = next(f for f, part in enumerate(self.parts) if i in part)
        return self.outer[f].state[self.anchor[i]]

    def rank_state(self) -> dict[str, torch.Tensor]:
        """The anchor, the outer momentum, the codec's state, and each round in flight waited for (its mean:
        the collective completes now instead of later, with the same result)."""
        out = {f"anchor/{n}": a for n, a in zip(self.names, self.anchor, strict=True)}
        for i, n in enumerate(self.names if self.outer else ()):
            buf = self._momentum(i).get("momentum_buffer")
            if buf is not None:
                out[f"momentum/{n}"] = buf
        for k, flight in enumerate(self.in_flight):
            mean = flight.mean()
            out.update({f"in_flight/{k}/{self.names[i]}": d for i, d in zip(flight.indices, mean, strict=True)})
        return {**out, **self.codec.state_tensors()}

    @torch.no_grad()
    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        self._reset_anchor()  # from the restored model
        flights, self._saved_flights = self._saved_flights, []
        if not tensors:
            self.codec.load_state_tensors({})
            return
        for i, (n, a) in enumerate(zip(self.names, self.anchor, strict=True)):
            a.copy_(tensors[f"anchor/{n}"])
            if self.outer and f"momentum/{n}" in tensors:
                self._momentum(i)["momentum_buffer"] = tensors[f"momentum/{n}"].clone()
        for k, saved in enumerate(flights):
            if max(saved["fragments"]) >= len(self.parts) or any(
                    f"in_flight/{k}/{self.names[i]}" not in tensors for f in saved["fragments"] for i in self.parts[f]):
                raise UserError(f"the checkpoint has a synchronisation in flight for fragments {saved['fragments']} "
                                f"of another split of the model; resume with the sync.fragments it was saved with, "
                                f"or from a checkpoint without one in flight")
            idx = [i for f in saved["fragments"] for i in self.parts[f]]
            deltas = [tensors[f"in_flight/{k}/{self.names[i]}"].clone() for i in idx]
            self.in_flight.append(InFlight(saved["fragments"], idx, saved["sent"], saved["due"], deltas, None))
        self.codec.load_state_tensors({k: v for k, v in tensors.items() if not k.startswith(OWN)})

    def merge_rank_states(self, states: list[dict[str, torch.Tensor]], world: int) -> dict[str, torch.Tensor]:
        """On another world size: the anchor, the outer momentum and the rounds in flight (averaged), the same
        on every rank, are the first's;
        the codec's residuals its merge (their mean)."""
        out = {k: v.clone() for k, v in states[0].items() if k.startswith(OWN)}
        out.update(self.codec.merge_state_tensors([{k: v for k, v in s.items() if not k.startswith(OWN)}
                                                   for s in states], world))
        return out

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
lowest survivor's after a failure: training/live.py).

With H = 1, outer lr 1 and no momentum both equal every-step data parallelism for an optimizer that
is linear in the gradient (SGD, with or without momentum): the mean of the replicas' updates is the
update of the mean gradient. AdamW is not linear, so they differ (tests/dist/test_sync_modes.py).
"""

from __future__ import annotations

import torch

from shoal.comm.codecs import Codec
from shoal.comm.log import CollectiveLog
from shoal.parallel.sync import EveryStep
from shoal.topology import local_part as local


class PeriodicSync:
    def __init__(self, mode: str, every: int, codec: Codec, outer_lr: float = 1.0, outer_momentum: float = 0.0,
                 last_step: int = 0, inner: EveryStep | None = None):
        if mode not in ("local-sgd", "diloco"):
            raise ValueError(f"unknown periodic sync {mode!r}")
        self.name, self.every, self.codec = mode, every, codec
        self.last_step = last_step  # synchronised whatever H, so that the run ends with one model
        # a replica of several ranks synchronises its gradients every step among them (the wrapper's)
        self.inner = inner or EveryStep(Codec(codec.comm))
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.SGD | None = None
        self.group, self.replicas = None, 1  # the dp group (None: the default group) and its size
        self.syncs = 0
        self.synced = 0  # the step of the last sync (0: the start, where the replicas are one model)

    def attach(self, model: torch.nn.Module, dp_group, dp: int) -> None:
        """This rank's whole model (all its stages), after wrapping; the anchor is its parameters now."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.group, self.replicas = dp_group, dp
        self._reset_anchor()

    @torch.no_grad()
    def _reset_anchor(self) -> None:
        self.anchor = [local(p).detach().float().clone() for p in self.params]
        self.outer = None
        if self.name == "diloco":
            self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                         nesterov=self.outer_momentum > 0)

    def install(self, module: torch.nn.Module, dp_group, log: CollectiveLog) -> None:
        self.inner.install(module, dp_group, log)  # only for a replica of several ranks

    def reduces(self, index: int, count: int) -> bool:
        return self.inner.reduces(index, count)  # without a wrapper, nothing to reduce whatever it says

    def after_backward(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        if step % self.every == 0 or step == self.last_step:
            self.sync()
            self.synced = step

    def in_sync(self, step: int) -> bool:
        return step == self.synced  # not at a step skipped as bad where a sync was due: it did not run

    def skipped(self) -> None:
        pass  # its codec runs only in sync(), after a step that was not skipped

    @torch.no_grad()
    def sync(self) -> None:
        """Collective over the dp group: average the pseudo-gradients, step the anchor, copy it back."""
        xs = [local(p) for p in self.params]
        deltas = [a - x.float() for a, x in zip(self.anchor, xs, strict=True)]
        if self.replicas > 1:  # a single replica has nothing to average (the outer step still runs)
            self.codec.all_reduce_mean(deltas, self.names, self.group, f"dp, {self.name} pseudo-gradient")
        if self.outer is None:
            for a, d in zip(self.anchor, deltas, strict=True):
                a.sub_(d)
        else:
            for a, d in zip(self.anchor, deltas, strict=True):
                a.grad = d
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        for x, a in zip(xs, self.anchor, strict=True):
            x.copy_(a)
        self.syncs += 1

    # --- checkpointed state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"syncs": self.syncs, "synced": self.synced}

    def load_state_dict(self, state: dict) -> None:
        self.syncs, self.synced = int(state.get("syncs", 0)), int(state.get("synced", 0))

    def rank_state(self) -> dict[str, torch.Tensor]:
        out = {f"anchor/{n}": a for n, a in zip(self.names, self.anchor, strict=True)}
        if self.outer is not None:
            for n, a in zip(self.names, self.anchor, strict=True):
                buf = self.outer.state.get(a, {}).get("momentum_buffer")
                if buf is not None:
                    out[f"momentum/{n}"] = buf
        return {**out, **self.codec.state_tensors()}

    @torch.no_grad()
    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        self._reset_anchor()  # from the restored model
        if not tensors:
            self.codec.load_state_tensors({})
            return
        for n, a in zip(self.names, self.anchor, strict=True):
            a.copy_(tensors[f"anchor/{n}"])
            if self.outer is not None and f"momentum/{n}" in tensors:
                self.outer.state[a]["momentum_buffer"] = tensors[f"momentum/{n}"].clone()
        self.codec.load_state_tensors({k: v for k, v in tensors.items() if not k.startswith(("anchor/", "momentum/"))})

    def merge_rank_states(self, states: list[dict[str, torch.Tensor]], world: int) -> dict[str, torch.Tensor]:
        """On another world size: the anchor and the outer momentum, the same on every rank, are the first's;
        the codec's residuals its merge (their mean)."""
        out = {k: v.clone() for k, v in states[0].items() if k.startswith(("anchor/", "momentum/"))}
        out.update(self.codec.merge_state_tensors(
            [{k: v for k, v in s.items() if not k.startswith(("anchor/", "momentum/"))} for s in states], world))
        return out

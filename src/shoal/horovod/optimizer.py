"""Horovod's DistributedOptimizer: the user's optimizer, whose step first averages the gradients over
every process.

As in Horovod, the result is an instance of a class made on the fly from the optimizer's own class
(it is still an SGD or an Adam, with the same parameter groups), built around a hook on each
parameter that fires once its gradient is accumulated. With backward_passes_per_step = k a gradient
is final on the k-th backward before a step (the k passes accumulate locally, then one exchange).
Final gradients are sent in buckets while backward goes on (exchange.py); `step()` waits for them,
unless `synchronize()` did already (`with optimizer.skip_synchronize(): optimizer.step()`, for
clipping the averaged gradients in between).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from shoal.errors import UserError
from shoal.horovod import compression as compressions
from shoal.horovod import ops, runtime
from shoal.horovod.exchange import GradientExchange
from shoal.horovod.process_sets import global_process_set, whole

LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's DistributedOptimizers (hvd.join steps with them)


def parameter_names(param_groups, named_parameters) -> dict:
    """Each optimized parameter's name (Horovod's checks: pairs, unique names, every parameter named)."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])}
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
        raise UserError("named_parameters: expected (name, parameter) pairs, as model.named_parameters() gives")
    names = [n for n, _ in pairs]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise UserError(f"named_parameters: names must be unique; repeated: {', '.join(dups)}")
    by_param = {p: n for n, p in pairs}
    unnamed = [p for g in param_groups for p in g["params"] if p not in by_param]
    if unnamed:
        raise UserError(f"named_parameters leaves {len(unnamed)} of the optimizer's parameters unnamed (shapes "
                        f"{[list(p.shape) for p in unnamed[:3]]}); pass model.named_parameters() of the whole model")
    return by_param


class _Distributed:
    """Put before the user's optimizer class; `super()` is that class."""

    def __init__(self, params, names, compression, backward_passes_per_step, op, gradient_predivide_factor,
                 sparse_as_dense, defaults):
        super().__init__(params)
        self.defaults = defaults  # the wrapped optimizer's, for parameter groups added later
        self.backward_passes_per_step = backward_passes_per_step
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        self._synchronized, self._should_synchronize = False, True
        trained = list({id(p): p for g in self.param_groups for p in g["params"] if p.requires_grad}.values())
        self._delay = dict.fromkeys(trained, backward_passes_per_step)
        self._fired: set = set()  # parameters whose gradient arrived since the last exchange
        rt = runtime.runtime()
        self._exchange = None
        if rt.place.size > 1:
            self._exchange = GradientExchange(trained, names, rt.comm, compression, op, gradient_predivide_factor,
                                              sparse_as_dense)
            me = weakref.ref(self)  # a parameter's hook does not keep a dropped optimizer alive
            for p in trained:
                p.register_post_accumulate_grad_hook(lambda q, me=me: me() is not None and me()._arrived(q))
        LIVE.add(self)

    def _arrived(self, p) -> None:
        if p not in self._delay:
            return
        if self._delay[p] <= 0:
            raise UserError(f"gradients were computed more than backward_passes_per_step="
                            f"{self.backward_passes_per_step} times before step(); raise backward_passes_per_step "
                            f"to accumulate more passes locally")
        self._delay[p] -= 1
        self._fired.add(p)
        if self._delay[p] == 0:
            self._exchange.ready(p)

    def synchronize(self) -> None:
        """Wait for every gradient's average (sending what backward did not); .grad then holds it."""
        if self._exchange is not None:
            self._exchange.finish()
        self._reset()
        self._synchronized = True

    def _reset(self) -> None:
        self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)
        self._fired.clear()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize (call synchronize() before it)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): the gradients are exchanged again", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._fired:
            raise UserError("optimizer.zero_grad() was called after loss.backward() and before optimizer.step() or "
                            "optimizer.synchronize(); zero the gradients before backward (or after step)")
        return super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict):
        self._reset()
        self._synchronized, self._should_synchronize = False, True
        return super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._reset()

    def shadow_step(self) -> bool:
        """A joined process's part in the others' step (hvd.join); False once every process has joined."""
        return self._exchange is not None and self._exchange.shadow()


def DistributedOptimizer(optimizer, named_parameters=None, compression=compressions.Compression.none,  # noqa: N802
                         backward_passes_per_step=1, op=ops.Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):
    """`optimizer` whose step() first averages (op=Average) or sums (op=Sum) the gradients over every process.

    num_groups / groups choose which gradients Horovod fuses into one all-reduce; shoal buckets them as DDP
    does whatever they say (they never change the result)."""
    whole(process_set)
    ops.check(op)
    compressions.check(compression)
    if op not in (ops.Average, ops.Sum):
        raise UserError(f"hvd.DistributedOptimizer(op={ops.NAMES[op]}): gradients are averaged (hvd.Average, the "
                        f"default) or summed (hvd.Sum)")
    if gradient_predivide_factor != 1.0 and (op != ops.Average or compressions.is_codec(compression)):
        raise UserError("gradient_predivide_factor splits an average of uncompressed or fp16 gradients; it needs "
                        "op=hvd.Average and compression none or fp16")
    if backward_passes_per_step < 1:
        raise UserError(f"backward_passes_per_step={backward_passes_per_step}: must be >= 1")
    names = parameter_names(optimizer.param_groups, named_parameters)
    cls = type(type(optimizer).__name__, (_Distributed, type(optimizer)), {"__module__": __name__})
    return cls(optimizer.param_groups, names, compression, backward_passes_per_step, op, gradient_predivide_factor,
               sparse_as_dense, optimizer.defaults)


def is_distributed(optimizer) -> bool:
    return isinstance(optimizer, _Distributed)


__all__ = ["DistributedOptimizer", "LIVE", "is_distributed", "torch"]

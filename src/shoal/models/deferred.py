"""Deferred initialisation: a model built on the meta device with a record of how one process would have
given each of its tensors its value, replayed later for only the tensors a rank holds (the idea of
torchdistx's deferred_init, on torch's dispatch modes).

    record     the model's builder runs as usual, but every tensor it creates is a meta tensor (no memory)
               and every operation on them is logged: factories, random fills, copies, arithmetic
    lay out    tensor / pipeline / ZeRO layouts are applied to the meta model (shapes only)
    replay     the log runs again on the CPU, in order, for the tensors this rank keeps: each one is
               computed whole, this rank's share of it copied out, and freed

The values are bitwise those of one process building the model on the CPU (which is where shoal builds
it): the same operations run in the same order on the same generators. Three things keep a build the one
its author wrote, though its tensors are on the meta device:
- code outside torch and shoal, and torch.nn.init, see each tensor as the CPU tensor it would be in one
  process (`is_meta` false, `device` the CPU): torch.nn.init's trunc_normal_, orthogonal_, dirac_ and
  sparse_ return early on a meta tensor, and so may a library's or a user's init; here they do their work,
  and it is logged like any other;
- a seed or generator state the build sets is logged as an operation (models/seeds.py);
- a tensor made from Python data or numpy (`nn.Parameter(torch.tensor([1.0, 0.5]))`) is logged with its
  value.

Every random operation is run, even one whose result nobody keeps (on a scratch tensor of the same shape,
freed at once), because it advances the generator the later ones draw from. An operation whose result is
overwritten before anyone reads it, or that feeds only tensors this rank does not keep, is skipped. So a
rank holds at any time its shares, plus the whole of the few tensors being computed: for a model built as
usual (each parameter created, then filled, then left alone), one parameter.

Storages, not tensor objects, carry values: `p.data`, `p[0]`, `p.t()` are new objects over the same
storage, and a parameter is whatever view of its storage it is. What a record cannot follow exactly
raises (models/seeds.py's Unrecordable, or the error of an operation the meta device cannot run, such as
reading a value back to the host with `.item()`); training/build.py then builds the model whole, and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from shoal.models.seeds import Generators, Unrecordable, set_state

# operations that overwrite their first argument whatever it held before (nn.init's fills, copy_): the
# storage's earlier history is dead when the argument covers it whole
_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
                         "geometric_", "cauchy_", "log_normal_"})


@dataclass(frozen=True)
class Ref:
    """A tensor of the record: a view of storage `key` (a meta storage, kept alive by the Recording)."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def whole(self, nbytes: int) -> bool:
        """Does this view cover its storage exactly once (row-major, from its start)?"""
        expected = 1
        for n, s in zip(reversed(self.size), reversed(self.stride), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return self.offset == 0 and expected * self.dtype.itemsize == nbytes


@dataclass
class Op:
    """One logged operation: `func` (an aten op, or a loader of stored values) over Refs and constants."""

    func: Callable
    args: tuple
    kwargs: dict
    outputs: tuple[Ref, ...]  # new storages it creates
    writes: tuple[Ref, ...]  # existing storages it changes in place
    reads: tuple[Ref, ...]
    random: bool
    overwrites: bool  # its writes do not depend on what the storage held
    needed: bool = False


@dataclass
class Recording:
    """The log of a model's build, and the generator state it started from."""

    ops: list[Op] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)  # meta storage -> its size
    rng_state: torch.Tensor | None = None
    _alive: list[torch.Tensor] = field(default_factory=list)  # keeps meta storages (their keys) unique

    def ref(self, t: torch.Tensor) -> Ref:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.nbytes:
            self.nbytes[key] = storage.nbytes()
            self._alive.append(t)
        return Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def load(self, target: torch.Tensor, read: Callable[[], torch.Tensor]) -> None:
        """Log that `target` (a meta tensor) takes the value `read()` returns, read only at replay (weights
        from a file: they are never held whole, only each tensor in turn)."""
        self.ops.append(Op(_loaded, (read,), {}, (), (self.ref(target),), (), random=False, overwrites=True))


def _loaded(read: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
    out.copy_(read())


def _constant(value: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(value)


def _logged_set_state(rec: Recording):
    return lambda generator, state: rec.ops.append(Op(set_state, (generator, state), {}, (), (), (), True, False))


class _Recorder(TorchDispatchMode):
    """Every tensor created is a meta tensor, and every operation is logged into `recording`."""

    def __init__(self, recording: Recording):
        super().__init__()
        self.rec = recording
        self._constants: dict[int, torch.Tensor] = {}
        self.generators = Generators(_logged_set_state(recording), recording.rng_state)

    def _meta(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor met in the build (a constant made from Python data): a meta twin whose value is
        logged as made by a copy of it."""
        if t.is_meta:
            return t
        twin = self._constants.get(id(t))
        if twin is None:
            twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            value = t.detach().clone()
            self.rec.ops.append(Op(_constant, (value,), {}, (), (self.rec.ref(twin),), (), False, True))
            self._constants[id(t)] = twin
            self.rec._alive.append(t)  # keeps id(t) unique
        return twin

    def log_call(self, frame) -> None:
        """Log the call of the function running in `frame` (a torch.nn.init function about to return early on
        a meta tensor) with the arguments it was given, to be made whole at replay: it overwrites its tensor,
        and may draw (the same draws on a scratch tensor, whose values are the same, where no one keeps it)."""
        code = frame.f_code
        function = frame.f_globals.get(code.co_name)
        if getattr(function, "__code__", None) is not code:
            raise Unrecordable(f"torch.nn.init's {code.co_name} skips its work on the meta device")
        given = {name: frame.f_locals[name] for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]}
        tensors = [v for v in given.values() if isinstance(v, torch.Tensor)]
        generators = [v for v in given.values() if isinstance(v, torch.Generator)]
        if len(tensors) != 1:
            raise Unrecordable(f"torch.nn.init's {code.co_name} skips its work on the meta device")
        self.generators.before_draw(generators[0] if generators else None)
        rec = self.rec
        rec.ops.append(Op(function, (), tree_map(_to_ref(rec), given), (), (rec.ref(tensors[0]),), (), random=True,
                          overwrites=True))

    def evaluate(self, t: torch.Tensor) -> torch.Tensor:
        """The value meta tensor `t` has at this point of one process's build, computed from the record: a
        value the build reads back to the host (`.item()`, `bool(t)`), such as a schedule from torch.linspace.
        Refused where it depends on a random draw (the record has not drawn: how far one process's generator
        had advanced is not known here) or on more than _EVALUATED bytes of tensors."""
        rec = self.rec
        ref = rec.ref(t)
        _plan(rec.ops, rec.nbytes, {ref.key})
        needed = [op for op in rec.ops if op.needed]
        if any(op.random for op in needed):
            raise Unrecordable("it reads back (.item()) a value that depends on a random draw")
        held = sum(rec.nbytes[k] for k in {r.key for op in needed for r in (*op.outputs, *op.writes, *op.reads)})
        if held > _EVALUATED:
            raise Unrecordable(f"it reads back (.item()) a value computed from {held / 2**20:.0f} MiB of tensors")
        got: list[torch.Tensor] = []
        replay(rec, {ref: [lambda value: got.append(value.clone())]}, draws=False)
        return got[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(): the value one process has here, now
            t = args[0] if args[0].is_meta else self._constants.get(id(args[0]))  # a constant edited in the build
            return func(args[0] if t is None else self.evaluate(t))
        if func in _LIFTS:
            # torch.tensor(data): left a CPU tensor (libraries ask `torch.tensor([]).device` where they are
            # being built, and skip their init on the meta device); made meta where it meets the model
            return args[0]
        args, kwargs = tree_map(lambda a: self._meta(a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        if "device" in kwargs or _has_device_arg(func):
            kwargs["device"] = torch.device("meta")  # a factory: where one process builds, the CPU, at replay
        if torch.Tag.inplace_view in func.tags:  # t_, unsqueeze_, set_: later operations are logged with the new view
            return func(*args, **kwargs)
        schema = func._schema
        if schema.name in _REFUSED:
            raise Unrecordable(f"it calls {schema.name}, which changes a storage's size")
        written = [a for a, spec in zip(_flat_args(schema, args, kwargs), schema.arguments, strict=False)
                   if spec.alias_info is not None and spec.alias_info.is_write and isinstance(a, torch.Tensor)]
        view = not written and any(r.alias_info is not None for r in schema.returns)
        if view:  # a view of what it was given: the same storage, nothing computed
            return func(*args, **kwargs)
        name = schema.name.split("::")[-1]
        if written and name.endswith("_"):  # in place: the result is its argument (no meta kernel run)
            out = args[0]
        else:
            out = func(*args, **kwargs)
        tensors_in = [a for a in _tensors((args, kwargs)) if not any(a is w for w in written)]
        outputs = [] if written else _tensors(out)
        random = torch.Tag.nondeterministic_seeded in func.tags
        if random:  # a seed the build set since the last draw is logged before it
            generators = [a for a in _flat_args(schema, args, kwargs) if isinstance(a, torch.Generator)]
            self.generators.before_draw(generators[0] if generators else None)
        rec = self.rec
        rec.ops.append(Op(func, tree_map(_to_ref(rec), args), tree_map(_to_ref(rec), kwargs),
                          tuple(rec.ref(o) for o in outputs), tuple(rec.ref(w) for w in written),
                          tuple(rec.ref(t) for t in tensors_in), random=random,
                          overwrites=name in _OVERWRITES or not written))
        for o in outputs:
            rec._alive.append(o)
        return out


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_REFUSED = frozenset({"aten::resize_", "aten::resize_as_"})
_EVALUATED = 64 * 2**20  # the most a value read back during a build may be computed from


class _AsOneProcess(TorchFunctionMode):
    """While a build is recorded: torch.nn.init's functions that return early on a meta tensor (trunc_normal_,
    orthogonal_, dirac_, sparse_ in torch 2.13) are logged as a call of the whole function, which the replay
    makes on the CPU tensor (the call is caught where the function asks `tensor.is_meta`, with the arguments
    it was given). Code outside torch and shoal sees each meta tensor as the CPU tensor it would be in one
    process (`is_meta` false, `device` and `is_cpu` the CPU's): libraries skip work there too (peft's
    SVD-based inits), which would leave the record without it; what they do instead is logged like any other
    operation. torch's own code, shoal's and the meta kernels are told the truth."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        prop = getattr(func, "__self__", None)  # a property's getter: the property
        if type(prop) is _PROPERTY and prop in _DEVICE_PROPERTIES and args and args[0].is_meta:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module == "torch.nn.init" and prop is torch.Tensor.is_meta:
                with _disable_current_modes():  # the generators' states are read on the CPU, not recorded
                    self.recorder.log_call(caller)
                return True  # the function returns early: its work is the logged call
            if _outside(module):
                return _DEVICE_PROPERTIES[prop]
        return func(*args, **(kwargs or {}))


_PROPERTY = type(torch.Tensor.is_meta)
_DEVICE_PROPERTIES = {torch.Tensor.is_meta: False, torch.Tensor.is_cpu: True, torch.Tensor.device: torch.device("cpu")}


def _outside(module: str) -> bool:
    """Is `module` code told a recorded tensor is the CPU tensor of one process: not torch's, not shoal's."""
    return not (module in ("torch", "shoal") or module.startswith(("torch.", "shoal.")))


def _has_device_arg(func) -> bool:
    return any(a.name == "device" for a in func._schema.arguments)


def _flat_args(schema, args, kwargs) -> list:
    """The op's arguments in schema order (positional, then by name)."""
    out = list(args)
    for spec in schema.arguments[len(args):]:
        out.append(kwargs.get(spec.name))
    return out


def _tensors(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda a: found.append(a) if isinstance(a, torch.Tensor) else a, tree)
    return found


def _to_ref(rec: Recording):
    return lambda a: rec.ref(a) if isinstance(a, torch.Tensor) else a


def record(build: Callable[[Recording], object]) -> tuple[object, Recording]:
    """Run `build(recording)` with every tensor it makes on the meta device and its operations logged into
    `recording` (which a build may also log into: Recording.load). Returns what it returned and the
    Recording. Raises Unrecordable, or the error of an operation the meta device cannot run, where the build
    cannot be replayed exactly. The CPU generator is left as it was, whatever the build set it to: a
    replay sets it, and a build of the whole model after a failed record starts where this one did."""
    recording = Recording(rng_state=torch.get_rng_state())
    recorder = _Recorder(recording)
    try:
        with _AsOneProcess(recorder), recorder:
            built = build(recording)
        recorder.generators.finish()
    finally:
        torch.set_rng_state(recording.rng_state)
    model = getattr(built, "model", built)  # a module, or a ModelBundle holding one
    if isinstance(model, torch.nn.Module):
        _all_meta(model, recorder)  # outside the recorder: the constants' values are copied on the CPU
    return built, recording


def _all_meta(model: torch.nn.Module, recorder: _Recorder) -> None:
    """Parameters and buffers the build left on the CPU (made from Python data by torch.tensor) become meta
    tensors whose value the record holds, like every other."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and not t.is_meta:
                    twin = recorder._meta(t)
                    if isinstance(t, torch.nn.Parameter):
                        twin = torch.nn.Parameter(twin, requires_grad=t.requires_grad)
                    table[name] = twin


Sink = Callable[[torch.Tensor], None]


def replay(recording: Recording, wanted: dict[Ref, list[Sink]], *, draws: bool = True) -> int:
    """Run the logged build again on the CPU for the tensors `wanted` names: each sink is called once with
    its tensor's final value (a CPU tensor, freed when the sinks return; a sink copies out what it keeps).
    `draws`: run every random operation, so that the values and the generator's state afterwards are one
    process's (False: only what the wanted tensors need, on the generator as it is; a resume, whose
    checkpoint brings the generator's state). The CPU generator ends as the build would have left it.
    Returns the most bytes held whole at once (values being computed, and a scratch tensor)."""
    by_key: dict[int, list[tuple[Ref, list[Sink]]]] = {}
    for ref, sinks in wanted.items():
        by_key.setdefault(ref.key, []).append((ref, sinks))
    last_use = _plan(recording.ops, recording.nbytes, set(by_key))
    values = _Values(recording.nbytes)

    def finish(key: int) -> None:
        for ref, sinks in by_key.pop(key, ()):
            value = values.view(ref)
            for sink in sinks:
                sink(value)
        values.free(key)

    caller_rng = torch.get_rng_state()
    if draws:
        torch.set_rng_state(recording.rng_state)
    with torch.no_grad():
        for i, op in enumerate(recording.ops):
            if op.needed:
                _run(op, values.view)
            elif op.random and draws:  # for the generator only: on scratch tensors, gone at once
                _run(op, values.scratch)
            for key in last_use.get(i, ()):
                finish(key)
        for key in list(by_key):  # never written in the build: as uninitialised as one process's
            finish(key)
    if not draws:
        torch.set_rng_state(caller_rng)
    return values.peak


class _Values:
    """The CPU storages a replay holds, by the record's storage key, and the most bytes they took at once."""

    def __init__(self, nbytes: dict[int, int]):
        self.nbytes, self.real = nbytes, {}
        self.held = self.peak = 0

    def view(self, ref: Ref) -> torch.Tensor:
        storage = self.real.get(ref.key)
        if storage is None:
            storage = self.real[ref.key] = torch.UntypedStorage(self.nbytes[ref.key])
            self.held += self.nbytes[ref.key]
            self.peak = max(self.peak, self.held)
        return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)

    def scratch(self, ref: Ref) -> torch.Tensor:
        self.peak = max(self.peak, self.held + self.nbytes[ref.key])
        return torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype).zero_()

    def free(self, key: int) -> None:
        if self.real.pop(key, None) is not None:
            self.held -= self.nbytes[key]


def _plan(ops: list[Op], nbytes: dict[int, int], roots: set[int]) -> dict[int, list[int]]:
    """Mark the operations the roots' final values depend on (walking back from the end: a storage is live
    until an operation that overwrites it whole, and an operation on a live storage makes what it reads
    live); returns, per operation, the storages whose last use it is."""
    live = set(roots)
    last: dict[int, int] = {}
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        targets = op.writes + op.outputs
        op.needed = any(t.key in live for t in targets)
        if not op.needed:
            continue
        for t in targets + op.reads:
            last.setdefault(t.key, i)
        for t in op.outputs:
            live.discard(t.key)
        for t in op.writes:
            if op.overwrites and t.whole(nbytes[t.key]):
                live.discard(t.key)
        live.update(r.key for r in op.reads)
    by_op: dict[int, list[int]] = {}
    for key, i in last.items():
        by_op.setdefault(i, []).append(key)
    return by_op


def _run(op: Op, tensor: Callable[[Ref], torch.Tensor]) -> None:
    def real(a):
        if isinstance(a, Ref):
            return tensor(a)
        return torch.device("cpu") if isinstance(a, torch.device) else a

    if op.func is set_state:
        op.func(*op.args)
        return
    if op.func in (_loaded, _constant):
        op.func(*op.args, tensor(op.writes[0]))
        return
    out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
    if op.outputs:  # a new tensor: into the storage the record gave it
        for ref, value in zip(op.outputs, _tensors(out), strict=True):
            tensor(ref).copy_(value)


@dataclass
class Deferred:
    """A model built by `record`: where each of its parameters and buffers is in the record, by name (tied
    weights under each of their names), and what a replay fills. `fresh`: a fresh start (every tensor from the
    build); otherwise a resume, whose checkpoint brings the parameters and persistent buffers, and only the
    `transient` ones (non-persistent buffers) are replayed."""

    recording: Recording
    names: dict[str, Ref]
    transient: frozenset[str]
    fresh: bool = True


def deferred(model: torch.nn.Module, recording: Recording, fresh: bool = True) -> Deferred:
    names = {name: recording.ref(t) for name, t in model.named_parameters(remove_duplicate=False)}
    transient = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, t in module._buffers.items():
            if t is not None:
                full = f"{module_name}.{name}" if module_name else name
                names[full] = recording.ref(t)
                if name in module._non_persistent_buffers_set:
                    transient.add(full)
    return Deferred(recording, names, frozenset(transient), fresh)

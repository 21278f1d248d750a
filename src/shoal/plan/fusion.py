"""What `train.compile` changes in a GPU step's kernels: torch.compile's Inductor fuses each run of
memory-bound operators between two matrix products (or attention) into one generated kernel, which reads
what enters the run and writes what leaves it, where eager mode launches every operator and writes and
reads back every intermediate. The products and attention keep their own kernels (cuBLAS, flash
attention), as Inductor leaves them by default.

The trace records which storage each operator reads and writes (Flow); `fused_bytes` then gives each
operator the bytes it moves compiled: a run's first operator its whole run's (what enters: tensors made
before the run; what leaves: tensors used after it, saved for backward, or a parameter's gradient), the
run's other operators FUSED (no kernel of their own). Runs do not cross the end of the forward: the
forward and the backward are compiled as two graphs.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

FUSED = -1.0  # an operator fused into the kernel of the run it belongs to


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Flow:
    """Per traced operator, the storages it reads and writes, each as (id, bytes): an id per storage made
    (a storage freed and its address reused gets a new one), and which of them must be in memory after the
    operator's run whatever the compiler fuses (saved for backward, a parameter's gradient)."""

    def __init__(self):
        self.ops: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
        self.ids: dict[int, int] = {}  # storage key -> id
        self.made = 0
        self.kept: set[int] = set()
        self.barriers: set[int] = set()  # operator indices a run may not cross (the forward's end)

    def _id(self, t: torch.Tensor) -> int:
        key = _key(t)
        if key not in self.ids:
            self.ids[key], self.made = self.made, self.made + 1
        return self.ids[key]

    def record(self, args, kwargs, out) -> None:
        ins = {self._id(t): t.untyped_storage().nbytes() for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)}
        outs = {self._id(t): t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        self.ops.append((list(ins.items()), list(outs.items())))

    def keep(self, t: torch.Tensor) -> None:
        self.kept.add(self._id(t))

    def barrier(self) -> None:
        self.barriers.add(len(self.ops))

    def forget(self, key: int) -> None:
        """A storage was freed: its address may be a new storage's."""
        self.ids.pop(key, None)


def fusable(flops: float) -> bool:
    """Inductor generates the kernel of every operator without FLOPs (element-wise, norms, reductions,
    casts, the loss, gathers); the products and attention, which have FLOPs, stay library kernels."""
    return not flops


def fused_bytes(items: list[tuple[str, float, float]], flow: Flow) -> list[float]:
    """Per operator the bytes it moves under torch.compile, FUSED for one folded into its run's kernel."""
    last_use: dict[int, int] = {}
    for i, (ins, _) in enumerate(flow.ops):
        for ident, _ in ins:
            last_use[ident] = i
    out = [moved for _, _, moved in items]
    i, n = 0, len(items)
    while i < n:
        if not fusable(items[i][1]):
            i += 1
            continue
        j = i + 1
        while j < n and fusable(items[j][1]) and j not in flow.barriers:
            j += 1
        made = {ident for k in range(i, j) for ident, _ in flow.ops[k][1]}
        reads = {ident: b for k in range(i, j) for ident, b in flow.ops[k][0] if ident not in made}
        writes = {ident: b for k in range(i, j) for ident, b in flow.ops[k][1]
                  if last_use.get(ident, -1) >= j or ident in flow.kept}
        out[i] = float(sum(reads.values()) + sum(writes.values()))
        out[i + 1:j] = [FUSED] * (j - i - 1)
        i = j
    return out

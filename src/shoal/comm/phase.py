"""Where in a step this rank is: the step, and the layer whose forward or backward runs.

Collectives that torch issues inside the model (FSDP2's all-gathers and reduce-scatters, DTensor's
tensor-parallel all-reduces, a pipeline's send/recv) carry no name of their own; the hang report
attributes them to the layer and direction this tracker last saw. A forward pre-hook, run before
FSDP2's own so that its all-gather is charged to the right layer, marks a layer's forward; a hook on
the layer's output gradient marks its backward. Both cost a Python call per layer and micro-batch.
Not installed under torch.compile, whose graphs run the layers as one piece.

Both hooks also call `check` (set by a live elastic run: live/connections.py's ConnectionWatch.check), which raises when
a peer is gone, so that a step that can no longer complete stops at its next layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Phase:
    def __init__(self):
        self.step: int | None = None  # 1-based: the step being trained
        self.layer: str | None = None
        self.direction = ""  # "forward" | "backward" | "" (outside the model)
        self.check: Callable[[], None] = lambda: None  # raises to end the step (see the module note)

    def begin_step(self, step: int) -> None:
        self.step, self.layer, self.direction = step, None, ""

    def outside(self, what: str) -> None:
        """Between model calls: what the step is doing ("optimizer", "validation", ...)."""
        self.layer, self.direction = None, what

    def describe(self) -> str:
        if self.step is None:
            return "start-up"
        where = f"{self.direction} of {self.layer}" if self.layer else self.direction or "data loading"
        return f"{where}, step {self.step}"

    def track(self, model: torch.nn.Module, block_types: tuple[type, ...]) -> None:
        """Follow the model's blocks and its other top-level layers."""
        for name, module in model.named_modules():
            # the top-level layers that hold weights (embeddings, a head) and the blocks
            top = name and "." not in name and any(True for _ in module.parameters(recurse=False))
            if top or (block_types and isinstance(module, block_types)):
                module.register_forward_pre_hook(self._forward(name), prepend=True)
                module.register_forward_hook(self._after_forward(name), prepend=True)

    def _forward(self, name: str):
        def hook(module, args):
            self.layer, self.direction = name, "forward"
            self.check()
        return hook

    def _after_forward(self, name: str):
        def mark_backward(grad):
            self.layer, self.direction = name, "backward"
            self.check()

        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(mark_backward)
        return hook

"""What to do with a step whose loss or gradient norm is NaN or infinite.

The check runs before the optimizer step, on values that are already identical on every rank (the
all-reduced loss and the norm of the all-reduced gradients), so all ranks decide the same without
talking; on the device, where the optimizer skips a bad step's update itself (parallel/precision.py),
and the loop learns of it when it reads the step's report (a step later on steps it does not log).
The learning-rate schedule follows the step count, bad steps included. Policies (train.on_bad_step):
  skip      drop the step's update, count it; abort after train.max_bad_steps bad steps in a row;
  rollback  reload the newest checkpoint and train on, skipping the offending batch; abort after
            train.max_bad_steps rollbacks;
  abort     stop the run at once.
With fp16 loss scaling an overflowing gradient is the scaler's business (it skips the step and lowers
the scale): only a non-finite loss counts there.
"""

from __future__ import annotations

import math

import torch

from shoal.errors import TrainingError


class BadStepPolicy:
    def __init__(self, policy: str, max_bad: int, scaled: bool):
        self.policy, self.max_bad, self.scaled = policy, max_bad, scaled
        self.total = 0  # bad steps seen
        self.in_a_row = 0
        self.rollbacks = 0

    def verdict(self, loss_sum: torch.Tensor, norms: torch.Tensor, on_host: bool = False) -> torch.Tensor | float:
        """Whether the step is bad: 1.0 or 0.0. Bad: the loss is not finite, or (except under fp16 loss scaling)
        `norms` is not (StepFlags.result: a gradient norm was not). The global loss sum stands for the loss: the
        mean divides it by a positive count of items (no items: the backward's scale is infinite, the gradients
        and their norm NaN). On the device (the optimizer skips the step there), in float32 as a fused optimizer
        takes it (`found_inf`): a value times zero is NaN exactly when it is not finite, at most four small
        operations where a comparison of each took seven. `on_host` (the CPU, where the host reads the values
        without waiting: Stepper.host_decides): a number, read from the two values."""
        if on_host:
            finite = math.isfinite(loss_sum.item()) and (self.scaled or math.isfinite(norms.item()))
            return 0.0 if finite else 1.0
        x = loss_sum if self.scaled else loss_sum + norms
        return (x * 0).float().nan_to_num(nan=1.0)

    def record_good(self) -> None:
        self.in_a_row = 0

    def record_bad(self, step: int, loss: float, grad_norm: float) -> str:
        """Count a bad step; returns "skip" or "rollback", or raises TrainingError to stop."""
        self.total += 1
        self.in_a_row += 1
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.policy == "abort":
            raise TrainingError(f'{what}; train.on_bad_step = "abort" stops the run (use "skip" or "rollback" '
                                f"to continue past such steps)")
        if self.policy == "skip":
            if self.in_a_row > self.max_bad:
                raise TrainingError(f"{what}: {self.in_a_row} bad steps in a row, more than train.max_bad_steps "
                                    f"({self.max_bad}); the run has diverged: lower train.lr or check the data")
            return "skip"
        self.rollbacks += 1
        if self.rollbacks > self.max_bad:
            raise TrainingError(f"{what}: rollback {self.rollbacks}, more than train.max_bad_steps ({self.max_bad}); "
                                f"the run keeps diverging: lower train.lr or check the data")
        return "rollback"

    def state_dict(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.in_a_row, self.rollbacks = state["total"], state["in_a_row"], state["rollbacks"]

"""metrics.trace_steps = [first, last]: a torch.profiler trace of those steps, written by every rank to
run_dir/traces/rank<r>.<time>.pt.trace.json (Chrome trace format: ui.perfetto.dev opens it, and
TensorBoard's profiler plugin reads the folder). CPU activity always, CUDA kernels on a GPU."""

from __future__ import annotations

from pathlib import Path

import torch


class StepTrace:
    def __init__(self, steps: list[int], out_dir: Path, rank: int, device: torch.device):
        self.first, self.last = steps if steps else (0, -1)
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.prof = None

    def before(self, step: int) -> None:
        """Step `step` (1-based) is about to run. The trace ends here once past its last step: a step is read
        once the next is queued, and what follows the last one is not the traced steps' work."""
        if self.prof is not None and step > self.last:
            self.close()
        if self.prof is None and self.first <= step <= self.last:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, record_shapes=True,
                                on_trace_ready=tensorboard_trace_handler(str(self.out_dir), f"rank{self.rank}"))
            self.prof.start()

    def after(self, step: int) -> None:
        """Step `step` is done: the trace is written after its last step."""
        if self.prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Write what was traced (also when the run ends or stops inside the range)."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the traced steps' kernels, run to their end, in the trace
            prof.stop()

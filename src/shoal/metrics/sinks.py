"""Where metrics go, on rank 0: the console (a rich progress bar, or plain lines when stdout is not a
terminal), metrics.jsonl (one JSON object per logged step), and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from shoal.rundir import RunDir


class ConsoleSink:
    def __init__(self, total_steps: int, start_step: int, items_name: str, show_bar: bool):
        self.console = Console(highlight=False, soft_wrap=True)
        self.items_name = items_name
        self.bar = None
        if show_bar and self.console.is_terminal:
            self.bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                TimeRemainingColumn(), console=self.console,
            )
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, loss="-", speed="-")
            self.bar.start()

    def print(self, text: str) -> None:
        self.console.print(text)

    def step(self, m: dict) -> None:
        """Every step: advance the bar (cheap); logged steps also print a line when there is no bar."""
        if self.bar is not None:
            self.bar.update(self.task, completed=m["step"], loss=f"{m['loss']:.4f}",
                            speed=f"{m[f'{self.items_name}_per_s']:,.0f} {self.items_name}/s")

    def log(self, m: dict) -> None:
        if self.bar is None:
            # the line written as it is, to the console's file (stdout): rich's console.out still measured the
            # terminal and laid the text out, ~0.2 ms of a small model's logged step here
            out = self.console.file
            out.write(f"step {m['step']:>6}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
                      f"{m[f'{self.items_name}_per_s']:,.0f} {self.items_name}/s  step {m['step_time_s'] * 1e3:.0f} ms "
                      f"(data wait {m['data_wait_s'] * 1e3:.1f} ms)" + (f"  MFU {m['mfu']:.1%}" if "mfu" in m else "")
                      + "\n")
            out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class JsonlSink:
    def __init__(self, path: Path):
        self.f = path.open("a", encoding="utf-8")

    def log(self, m: dict) -> None:
        # NaN/inf are not JSON: write them as null so every line stays parseable
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
        self.f.write(json.dumps(clean) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.writer = SummaryWriter(str(log_dir))

    def log(self, m: dict) -> None:
        for key, value in m.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, m["step"])

    def close(self) -> None:
        self.writer.close()


class MetricsSinks:
    """All sinks of rank 0; other ranks get an instance with no sinks, so callers need no rank checks."""

    def __init__(self, run_dir: Path | None, total_steps: int, start_step: int, items_name: str,
                 tensorboard: bool, show_bar: bool):
        self.console = None
        self.files: list = []
        if run_dir is not None:
            self.console = ConsoleSink(total_steps, start_step, items_name, show_bar)
            run = RunDir(run_dir)
            self.files.append(JsonlSink(run.metrics))
            if tensorboard:
                self.files.append(TensorBoardSink(run.tensorboard))

    def print(self, text: str) -> None:
        if self.console:
            self.console.print(text)

    def step(self, m: dict) -> None:
        if self.console:
            self.console.step(m)

    def log(self, m: dict) -> None:
        if self.console:
            self.console.log(m)
        for sink in self.files:
            sink.log(m)

    def event(self, m: dict) -> None:
        """A line of the record that is not a step's metrics (a live run's change of the group): the files only."""
        for sink in self.files:
            sink.log(m)

    def close(self) -> None:
        """Close every sink (once: a later call does nothing)."""
        for sink in [self.console, *self.files]:
            if sink:
                sink.close()
        self.console, self.files = None, []

"""benchmarks/gpu_step.py's count of the host syncs inside `shoal train`, which has no hook of its own for it.

This folder goes first on PYTHONPATH of one `shoal train` run only, with GPU_STEP_SYNC_LOG=<prefix>; every Python
process of the run (the launcher, the forkserver its workers are forked from) imports it at start. It wraps
torch.cuda.synchronize and torch.cuda.Event.synchronize (explicit syncs, which torch's sync debug mode does not
report) and queues, for when CUDA initialises in a process (a worker: never the launcher or the server, whose
forked children could not use CUDA then), torch.cuda.set_sync_debug_mode("warn"), whose warnings (implicit syncs:
.item(), .tolist(), .cpu(), a copy to the host, a stream's synchronize) it takes out of the warnings' output. Each
sync appends `<time.time()> <kind> <file:line>` to <prefix>.<pid>; gpu_step.py counts the lines between the
time stamps of two logged steps in metrics.jsonl. Nothing here may break the run: any failure leaves it as it was.
"""

import os


def _install(prefix: str) -> None:
    import sys
    import time
    import warnings

    import torch

    text = "called a synchronizing CUDA operation"
    files: dict[int, int] = {}

    def record(kind: str, site: str) -> None:
        pid = os.getpid()  # a forked worker writes a file of its own
        if pid not in files:
            files[pid] = os.open(f"{prefix}.{pid}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(files[pid], f"{time.time():.6f} {kind} {site}\n".encode())

    def caller(depth: int = 2) -> str:
        frame = sys._getframe(depth)
        return f"{frame.f_code.co_filename}:{frame.f_lineno}"

    synchronize = torch.cuda.synchronize

    def counted_synchronize(device=None):
        record("synchronize", caller())
        return synchronize(device)

    event_synchronize = torch.cuda.Event.synchronize

    def counted_event_synchronize(self):
        record("event", caller())
        return event_synchronize(self)

    torch.cuda.synchronize = counted_synchronize
    torch.cuda.Event.synchronize = counted_event_synchronize

    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(text):
            record("implicit", f"{filename}:{lineno}")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.filterwarnings("always", message=text)

    def on_cuda_init() -> None:
        torch._C._cuda_set_sync_debug_mode(1)  # "warn"; the public setter would initialise CUDA itself
        record("cuda-init", caller(1))

    torch.cuda._lazy_call(on_cuda_init)
    record("installed", " ".join(sys.argv[:3]).replace(" ", "_") or "-")


if os.environ.get("GPU_STEP_SYNC_LOG"):
    try:
        _install(os.environ["GPU_STEP_SYNC_LOG"])
    except Exception as e:  # the run goes on uncounted; gpu_step.py says the hook did not install
        import sys

        print(f"gpu_step_syncs: not installed: {type(e).__name__}: {e}", file=sys.stderr)

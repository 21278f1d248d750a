"""One worker of `shoal run`: the user's script (or module) as `python script.py ARGS` would run it.

    python -m shoal.launch.script [--cpu] [--horovod] (PATH | -m MODULE) [ARGS...]

torch elastic has already set the worker's environment (torchrun's contract: RANK, WORLD_SIZE,
LOCAL_RANK, ...). The script runs as __main__ with sys.argv and sys.path[0] as Python would set them
(the script's folder; for a module, the working directory), so it cannot tell this from torchrun.
Around it: the hang report for the script's own collectives (watch.py).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from shoal.dist import exit_process
from shoal.errors import UserError
from shoal.launch.watch import Watch


def main(argv: list[str]) -> None:
    if argv[:1] == ["--cpu"]:
        from shoal.launch import cpu

        cpu.install()
        argv = argv[1:]
    if argv[:1] == ["--horovod"]:  # `import horovod.torch` is shoal's Horovod API (shoal/horovod/alias.py)
        from shoal.horovod import alias

        alias.install()
        argv = argv[1:]
    watch = Watch()
    watch.install()
    try:
        run(argv)
    except SystemExit as e:
        end(exit_code(e))
    except KeyboardInterrupt:
        raise
    except UserError as e:  # shoal's own refusal (a Session's config, a call out of order): one line, code 2
        print(f"shoal: error: {e}", file=sys.stderr, flush=True)
        end(2)
    except BaseException as e:  # noqa: BLE001 - as Python ends a script: its traceback, then exit code 1
        traceback.print_exc()
        watch.failed(e)
        end(1)
    end(0)


def exit_code(e: SystemExit) -> int:
    """The process's exit code for sys.exit(e.code), as Python computes it (a message: printed, then 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def end(code: int) -> None:
    """Leave as Python would (its non-daemon threads joined, atexit handlers run, output flushed) but
    without C++'s static destructors: after a script whose work is all done, gloo's can abort the
    process with SIGABRT ("terminate called without an active exception": 2 of 20 plain DDP runs here),
    which would make a finished script a failed worker. shoal's own workers end so too ([Note: exit])."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    exit_process(code)


def run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file name in sys.argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

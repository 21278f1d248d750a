"""`hvd.elastic.run`: an elastic training function, mapped onto shoal's restarts.

Horovod runs the function and, when a process fails or hosts change, catches the error in the
processes that survive, restores their last commit, re-forms the job and calls the function again.
Under shoal a failure ends the job's processes and the launcher starts them all again (`shoal run
--max-restarts N`): each new process runs the script from its start, and when it reaches the
function, `run` reads its last commit from disk, makes every process take the newest one (sync), calls
the reset callbacks (the job was reset), then calls the function, which goes on from the committed
point. Without a failure, it is Horovod's first call: sync from rank 0, then the function.
"""

from __future__ import annotations

import functools


def run(func):
    """Decorate `func(state, ...)`, whose first argument is a TorchState (or any hvd.elastic State)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.resume()
        if state.sync():  # True: a process read its commit from disk, the job was restarted
            state.on_reset()
        result = func(state, *args, **kwargs)
        state.forget()
        return result

    return wrapper

"""When this process started (imported first by the package): the recovery-time breakdown in
summary.json measures a restarted worker's start-up from here. A worker forked from a preloaded server
([Note: forked workers] in launch/restart.py) imported this module long before it existed: the clock
starts again in every child."""

import os
import time

_started = time.time()


def _forked() -> None:
    global _started
    _started = time.time()


os.register_at_fork(after_in_child=_forked)


def started_at() -> float:
    """This process's start (its fork, for a forked worker), in seconds since the epoch."""
    return _started

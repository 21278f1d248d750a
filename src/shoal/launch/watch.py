"""The hang report for a user's own script under `shoal run`, as `shoal train` gives it.

A script makes its own process group and calls torch.distributed itself (DDP's gradient all-reduce,
an explicit all_reduce of its loss). In each worker, before the script starts, torch's flight recorder
is switched on (TORCH_FR_BUFFER_SIZE, read when a group is made) and init_process_group is wrapped: once
the script's group exists, a watchdog thread publishes where this rank is to the launcher's store, once
a second (comm/watchdog.py), over a connection of its own. When the script then dies of an exception
raised in a collective (the group's timeout, a peer gone), the report names the collective, the rank
that did not arrive (behind on the flight recorder's count, or outside any collective) and its file:line;
gloo raises it after the group's timeout, so the report comes within that timeout and a second or two.

A script that catches the collective's exception itself gets no report: nothing reaches the wrapper.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from shoal.comm import flight
from shoal.comm.log import CollectiveLog
from shoal.comm.phase import Phase
from shoal.comm.report import hang_report
from shoal.comm.watchdog import Watchdog


class ScriptPhase(Phase):
    """A user's script has no steps shoal can see: its phase is the script."""

    def describe(self) -> str:
        return "the script"


class Watch:
    """This worker's watchdog, started when the script's process group is."""

    def __init__(self):
        self.watchdog: Watchdog | None = None
        self.timeout = timedelta(0)

    def install(self) -> None:
        flight.enable()
        init = dist.init_process_group

        @functools.wraps(init)
        def init_process_group(*args, **kwargs):
            init(*args, **kwargs)
            self.started(kwargs.get("timeout"))

        dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group

    def started(self, timeout: timedelta | None) -> None:
        if self.watchdog is not None or "MASTER_ADDR" not in os.environ:
            return
        backend = dist.get_backend()
        self.timeout = timeout or dist.distributed_c10d._get_default_timeout(backend)
        env = os.environ
        # a second connection to the launcher's store (torch elastic's agent hosts it), so that the
        # watchdog never waits behind the script's own store traffic; keys per restart attempt
        side = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=10), wait_for_workers=False)
        store = dist.PrefixStore(f"shoal/run/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", side)
        self.watchdog = Watchdog(CollectiveLog(), store, dist.get_rank(), ScriptPhase())

    def failed(self, error: BaseException) -> None:
        """The script ended with `error`: when a collective raised it, the report after its traceback."""
        if self.watchdog is None or not dist.is_initialized():
            return
        seconds = self.timeout.total_seconds()
        report = hang_report(error, self.watchdog, dist.get_world_size(),
                             f"{seconds:.0f} s (the process group's timeout)")
        if report:
            print(f"shoal: {report}", file=sys.stderr, flush=True)

"""Horovod's process sets: only the global one (every process) exists here.

Horovod lets an operation run over a subset of the processes. shoal's Horovod runs every operation
over all of them; a script that makes a set of its own is refused in one line.
"""

from __future__ import annotations

from shoal.errors import UserError
from shoal.horovod import runtime


class ProcessSet:
    def __init__(self, ranks=None):
        self.ranks = ranks

    def included(self) -> bool:
        return True

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = ProcessSet()

REFUSED = ("process sets other than the global one are not supported by shoal's Horovod: every operation runs "
           "over all processes (leave process_set out)")


def whole(process_set) -> None:
    """Refuse an operation over any set but the global one."""
    if process_set is not None and process_set is not global_process_set:
        raise UserError(f"process_set={process_set!r}: {REFUSED}")


def add_process_set(process_set):
    raise UserError(f"hvd.add_process_set: {REFUSED}")


def remove_process_set(process_set):
    raise UserError(f"hvd.remove_process_set: {REFUSED}")

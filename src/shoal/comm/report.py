"""Hang diagnosis, part two: when a collective fails (a timeout after parallel.timeout_s, or a peer
that died), the rank that saw it prints one report instead of a bare backend error: which collective,
and for every rank whether it waits in a collective too or never arrived, and where it was.

A rank counts as not arrived when its main thread is outside any collective while others wait
(watchdog.py), or when torch's flight recorder shows it enqueued fewer collectives on the failing
group than the collective this rank waits in.
"""

from __future__ import annotations

import re
import time

from shoal.comm.log import describe


def reason(error: BaseException) -> str:
    """The backend's own words, without the wrappers DDP and gloo put around them."""
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    last = first.split("Error: ")[-1]  # innermost of "RuntimeError: ... callback: RuntimeError: <why>"
    return re.sub(r"^\[[^\]]*\]\s*", "", last)[:200]  # drop gloo's "[/path/file.cc:78]"


def pending_group(status: dict) -> tuple[str, dict] | None:
    """The process group on which this status has a collective enqueued and not completed."""
    for name, group in status.get("groups", {}).items():
        if group.get("enqueued", -1) > group.get("completed", -1):
            return name, group
    return None


def hang_report(error: BaseException, watchdog, world_size: int, timeout: str) -> str | None:
    """The report for `error`, raised on this rank (whose Watchdog is `watchdog`; it is stopped here), from
    every rank's newest status in the store; None when the error was not raised in a collective.
    `timeout` says how long a collective waits, for when the wait's start is unknown."""
    mine = watchdog.failure_status(error)
    watchdog.stop()
    statuses = {r: watchdog.read(r) for r in range(world_size)}
    return collective_report(mine, watchdog.rank, statuses, error, timeout)


def collective_report(mine: dict | None, rank: int, statuses: dict[int, dict | None], error: BaseException,
                      timeout: str) -> str | None:
    """The report, from this rank's status at the failure (`mine`, Watchdog.failure_status) and every
    rank's newest status; None when this rank was not waiting in a collective (not a hang)."""
    if mine is None:
        return None
    if mine.get("blocked_since"):  # from the wait's start, or (sampled once a second) at least this long
        seconds = time.time() - mine["blocked_since"]
        waited = f"{seconds:.1f} s" if mine.get("since_exact") else f"at least {int(seconds)} s"
    else:
        waited = f"about {timeout}"
    group = pending_group(mine)
    what = mine["blocked"]
    seq = None
    if group is not None:  # what torch's flight recorder saw this rank issue last on the waiting group
        name, g = group
        seq = g["enqueued"]  # the newest it entered: gloo's completed count can lag (comm/flight.py)
        what = f"{what} [{g.get('last_op', 'collective')} on group {g['desc']}, #{seq} there]"
    lines = [f"collective {what} during {mine['phase']} failed on rank {rank} after {waited}: {reason(error)}"]
    for r in sorted(statuses):
        status = statuses[r] if r != rank else mine
        if status is None:
            lines.append(f"  rank {r}: no status published (it may have died before its first report)")
            continue
        age = time.time() - status["time"]
        state = _state(status, group, seq, r)
        lines.append(f"  rank {r}: {state}; was at {status['where']} during {status['phase']} ({age:.0f} s ago)")
    return "\n".join(lines)


def _state(status: dict, group: tuple[str, dict] | None, seq: int | None, rank: int) -> str:
    behind = ""
    if group is not None and rank in group[1].get("ranks", [rank]):
        theirs = status.get("groups", {}).get(group[0], {})
        enqueued = theirs.get("enqueued")
        if enqueued is not None and enqueued < seq:
            behind = f"DID NOT ARRIVE at #{seq} on group {group[1]['desc']} (entered up to #{enqueued} there)"
    blocked, last = status.get("blocked"), describe(status.get("last"))
    if behind:
        # no collective log (a user's script under `shoal run`): the recorder's count says it all
        last = f"; last entered {last}" if status.get("last") is not None else ""
        return f"{behind}: {'waiting in ' + blocked if blocked else 'outside any collective'}{last}"
    if blocked is not None:
        return f"waiting in {blocked}"
    return f"DID NOT ARRIVE: outside any collective; last entered {last}"

"""torch's flight recorder: a ring buffer, per process, of the collectives every process group
issued, including those torch issues on shoal's behalf (FSDP2, DTensor, DCP). Measured with torch
2.13 and gloo: each group's counters of collectives enqueued and completed are kept (so a rank that
never enqueued the collective its peers wait in shows up one behind), a dump takes under 1 ms; gloo's
point-to-point send/recv (pipeline stages) is not recorded, which the main thread's stack covers.
The recorder is off unless TORCH_FR_BUFFER_SIZE is set before the process group is made."""

from __future__ import annotations

import json
import os

BUFFER = "256"  # entries kept: enough for several steps of a model sharded block by block


def enable() -> None:
    """Call before the first process group is created (a user's own setting wins)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER)


def summary() -> dict[str, dict]:
    """Per process group (by its name, the same on every rank): its description and ranks, how many
    collectives this rank enqueued and completed on it, and the newest one's op and shapes. {} when the
    recorder is off or unavailable."""
    try:
        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace_json

        dump = json.loads(_dump_fr_trace_json(True, False))
        ranks = {name: dist.get_process_group_ranks(pg) for pg, name in dist.distributed_c10d._world.pg_names.items()}
    except Exception:  # noqa: BLE001 - no recorder in this build or backend: the report does without
        return {}
    out: dict[str, dict] = {}
    names: dict[str, str] = {}  # the recorder's group id -> the group's name
    for entry in dump.get("entries", []):
        if entry.get("is_p2p"):
            continue
        name, desc = entry["process_group"]
        names[str(entry["pg_id"])] = name
        sizes = ", ".join(str(s) for s in entry.get("input_sizes", []))
        out[name] = {"desc": desc, "ranks": ranks.get(name, []),
                     "last_op": f"{entry['profiling_name'].split(':')[-1]} ({sizes})"}
    for pg_id, status in dump.get("pg_status", {}).items():
        if pg_id in names:
            out[names[pg_id]].update(enqueued=int(status["last_enqueued_collective"]),
                                     completed=int(status["last_completed_collective"]))
    for entry in dump.get("entries", []):  # when the oldest collective still pending was issued
        group = out[entry["process_group"][0]] if not entry.get("is_p2p") else {}
        if entry.get("collective_seq_id", 0) > group.get("completed", 1 << 62) and "pending_since" not in group:
            group["pending_since"] = entry["time_created_ns"] / 1e9
    return out

"""comm/flight.py's reading of torch's flight recorder, against a scripted recorder: the per-group
counters every time, the whole ring (milliseconds with the GIL held) only when a collective is
pending or a group is new; destroyed groups left out; a name reused by a newer group means the newer
one. The real recorder is read in tests/dist/test_strategies.py."""

import json

import pytest
import torch._C._distributed_c10d as c10d
import torch.distributed
import torch.distributed.distributed_c10d as dist_c10d

from shoal.comm import flight


class Group:  # stands for a ProcessGroup: only its identity matters
    pass


class Recorder:
    def __init__(self):
        self.status: dict[str, tuple[int, int]] = {}  # pg id -> (enqueued, completed)
        self.entries: list[dict] = []
        self.full_reads = 0

    def issue(self, pg_id: int, name: str, op: str, size: int, at: float) -> None:
        e, c = self.status.get(str(pg_id), (0, 0))
        self.status[str(pg_id)] = (e + 1, c)
        self.entries.append({"pg_id": pg_id, "process_group": [name, f"desc {name}"], "collective_seq_id": e + 1,
                             "profiling_name": f"gloo:{op}", "input_sizes": [[size]], "time_created_ns": int(at * 1e9)})

    def complete(self, pg_id: int) -> None:
        e, _ = self.status[str(pg_id)]
        self.status[str(pg_id)] = (e, e)

    def dump(self, include_entries=True, only_active=False) -> bytes:
        self.full_reads += bool(include_entries)
        out = {"pg_status": {k: {"last_enqueued_collective": str(e), "last_completed_collective": str(c)}
                             for k, (e, c) in self.status.items()}}
        if include_entries:
            out["entries"] = self.entries
        return json.dumps(out).encode()


@pytest.fixture
def world(monkeypatch):
    class World:
        pg_names: dict = {}

    monkeypatch.setattr(dist_c10d, "_world", World())
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda pg: [0, 1])
    recorder = Recorder()
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", recorder.dump)
    monkeypatch.setattr(flight, "_groups", flight._Groups())
    return World.pg_names, recorder


def test_the_ring_is_read_only_when_a_collective_is_pending_or_a_group_is_new(world):
    live, rec = world
    live[Group()] = "0"
    rec.issue(0, "0", "all_reduce", 4, at=10.0)
    rec.complete(0)
    assert flight.summary() == {"0": {"name": "0", "desc": "desc 0", "ranks": [0, 1], "last_op": "all_reduce ([4])",
                                      "enqueued": 1, "completed": 1}}
    assert rec.full_reads == 1  # a new group
    for _ in range(3):
        flight.summary()
    assert rec.full_reads == 1  # idle: counters only

    rec.issue(0, "0", "all_gather", 8, at=20.0)  # pending: the ring says what and since when
    assert flight.summary()["0"] == {"name": "0", "desc": "desc 0", "ranks": [0, 1], "last_op": "all_gather ([8])",
                                     "pending_since": 20.0, "enqueued": 2, "completed": 1}
    assert rec.full_reads == 2
    rec.complete(0)
    assert "pending_since" not in flight.summary()["0"]


def test_destroyed_groups_are_left_out_and_a_reused_name_means_the_newest_group(world):
    live, rec = world
    old = Group()
    live[old] = "0"
    rec.issue(0, "0", "all_reduce", 4, at=1.0)
    rec.complete(0)
    flight.summary()
    del live[old]  # destroyed; a new group takes its name, with a new recorder id
    live[Group()] = "0"
    rec.issue(1, "0", "broadcast", 16, at=2.0)
    rec.issue(1, "0", "broadcast", 16, at=3.0)
    rec.complete(1)
    got = flight.summary()
    assert list(got) == ["0"] and got["0"]["last_op"] == "broadcast ([16])" and got["0"]["enqueued"] == 2


def test_a_lagging_completed_count_dates_the_wait_from_the_newest_collective(world):
    """gloo's completed count can stay behind collectives that completed (seen under load: 6 while #7-#9 had
    completed on every rank); the wait a blocked rank is in started at its newest collective."""
    live, rec = world
    live[Group()] = "0"
    for at in (10.0, 11.0, 12.0):
        rec.issue(0, "0", "all_reduce", 4, at=at)
    rec.status["0"] = (3, 1)  # #2 completed, the count says 1
    assert flight.summary()["0"]["pending_since"] == 12.0

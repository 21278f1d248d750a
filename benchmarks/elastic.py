"""Goodput under repeated failures: a live elastic run against today's restart-and-resume.

Four hosts of a cluster on this machine (`shoal cluster up --hosts 4`: network namespaces), one worker
each with one thread, the default job's GPT (configs/gpt-tiny.toml: 4 layers, d_model 128) at global
batch 48 in micro-batches of 4 (the default job's 32 does not divide among 3 workers; a live run's
batch must divide among every world size its range allows). For `--minutes` (5) of training, a
worker on a random host other than h0 (h0 hosts the store / rendezvous) is SIGKILLed every `--every`
seconds (30), and a replacement node
starts on that host `--replace-after` seconds later (10). The failure times and victims come from
`--seed`, so every mode meets the same failures.

Modes:
  live             `--nnodes 2:4 --max-restarts 0`: the survivors regroup and go on; the replacement
                   node joins and heals from a live peer (docs/elastic.md)
  restart-30s      `--nnodes 4`, a checkpoint every 30 s (checkpoint.interval_minutes = 0.5): the failed
                   job ends on every node, and all four nodes are started again (resume from the newest
                   checkpoint) once the replacement host is there: what a scheduler's requeue does
  restart-default  the same at the default checkpoint cadence (every 10 minutes)
  torchft          the same job under torchft 0.2.0 (benchmarks/torchft_ddp.py: a replica group per host,
                   its lighthouse on h0 as its README starts it): the survivors go on without the dead
                   replica's share of the batch, and the replacement heals from a live peer; left out, in
                   one line, where torchft is not installed (pip install -e '.[torchft]')
and, first, `failure-free`: the live launch with no failure, for `--baseline-minutes` (1.5), and the
same for torchft (its goodput is over its own failure-free run).

Per mode: useful samples (the step the run's own trajectory has reached when the time is up, times the
global batch: work lost to a restart is not counted; for torchft, each committed step's participants x
a replica's share: a dropped share is not counted) per second of training (from the first step), and
goodput = that / the failure-free run's samples per second over its own window. For the live mode also,
from rank 0's metrics.jsonl (a line per step): each failure's stall (the gap between the step before the
group changed and the step after, less the median step: in seconds and in steps), the pause when the
replacement joins (the same gap at the join), and a joiner's time from its node's start to the first
step it takes part in. For the restart modes: per failure, the time until the run is back at the step it
had reached when the worker died, and a restarted job's time from start to its first step.

    sudo python -m benchmarks.elastic [--minutes 5] [--every 30] [--replace-after 10] [--seed 0]
                                      [--modes live,restart-30s,restart-default]

Last line:
    RESULT goodput_live=<x> goodput_restart=<y> stall_s=<median> join_s=<median> goodput_torchft=<z>
goodput_restart is the 30 s checkpoint mode (the default cadence's is printed in the table). Targets:
goodput_live >= 0.85; stall_s <= 2 steps' time (the median step is printed); join_s <= 15.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shoal.launch.supervisor import descendants  # noqa: E402
from shoal.testbed import hosts  # noqa: E402
from shoal.testbed.nodes import free_port  # noqa: E402
from shoal.testbed.system import netns_exec  # noqa: E402

CONFIG = ROOT / "configs" / "gpt-tiny.toml"
BATCH = 48
SETS = ["train.steps=1000000", f"train.global_batch_size={BATCH}", "train.micro_batch_size=4", "train.val_interval=0",
        "parallel.threads_per_worker=1", "metrics.log_interval=1",
        "metrics.tensorboard=false", "metrics.progress=false", "checkpoint.final_weights=false"]
MODES = {
    "live": (["--nnodes", "2:4", "--max-restarts", "0"], []),
    "restart-30s": (["--nnodes", "4", "--max-restarts", "0"], ["checkpoint.interval_minutes=0.5"]),
    "restart-default": (["--nnodes", "4", "--max-restarts", "0"], []),
    "torchft": ([], []),  # benchmarks/torchft_ddp.py on each host, torchft's lighthouse on h0
}
POLL_S = 0.1
MICRO = 4
# torchft's lighthouse as its README starts it (a quorum every 100 ms, stragglers awaited up to 10 s); a
# replica is dead once its heartbeat has been silent for heartbeat_timeout_ms (its default, 5 s)
LIGHTHOUSE = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


def shoal(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=ROOT, text=True, **kw)


class Job:
    """The nodes of one run, one per host, and when it reached which step (progress.json, polled)."""

    def __init__(self, cluster, mode: str, run_dir: Path, log: Path):
        self.cluster, self.mode, self.run_dir, self.log = cluster, mode, run_dir, log
        self.endpoint = f"{cluster.hosts[0].addr}:{free_port(cluster.hosts[0])}"
        self.nodes: dict[int, subprocess.Popen] = {}
        self.progress: list[tuple[float, int]] = []  # (time, step) as progress.json said
        self.starts: list[tuple[float, int]] = []  # (time, host index) each node was started

    def start(self, i: int, resume: bool = False) -> None:
        launch, sets = MODES[self.mode]
        host = self.cluster.hosts[i]
        argv = [*netns_exec(host.netns), sys.executable, "-m", "shoal", "train", str(CONFIG), *launch,
                "--nproc", "1", "--node-rank", str(i), "--rdzv-endpoint", self.endpoint, "--run-dir", str(self.run_dir),
                *(["--resume", "auto"] if resume else []), *[a for kv in [*SETS, *sets] for a in ("--set", kv)]]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": host.ifname, "PYTHONUNBUFFERED": "1"}
        if self.mode == "torchft":  # one replica group per host, its share of the global batch
            argv = [*netns_exec(host.netns), sys.executable, str(ROOT / "benchmarks" / "torchft_ddp.py")]
            env.update(REPLICA_GROUP_ID=str(i), HOST_ADDR=host.addr, TORCHFT_LIGHTHOUSE=f"http://{self.endpoint}",
                       RUN_DIR=str(self.run_dir), BATCH=str(BATCH // len(self.cluster.hosts)), MICRO=str(MICRO))
        out = open(self.log.with_suffix(f".h{i}.{len(self.starts)}.log"), "w")  # noqa: SIM115 - the node's own file
        self.nodes[i] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.starts.append((time.time(), i))

    def poll(self) -> int:
        """The step the run has reached (0 before its first)."""
        try:
            got = json.loads((self.run_dir / "progress.json").read_text())
        except (OSError, ValueError):
            return self.progress[-1][1] if self.progress else 0
        if not self.progress or self.progress[-1] != (got["time"], got["step"]):
            self.progress.append((got["time"], got["step"]))
        return got["step"]

    def kill_worker(self, i: int) -> bool:
        """SIGKILL the worker of the node on host i (its launcher sees it end): the process a worker names
        "shoal rank N" once it is in its group. False: none yet (the node is still starting). A torchft
        replica is the node's process itself."""
        if self.mode == "torchft":
            os.kill(self.nodes[i].pid, signal.SIGKILL)
            return True
        for pid in descendants(self.nodes[i].pid):
            try:
                name = Path(f"/proc/{pid}/comm").read_text()
            except OSError:
                continue
            if name.startswith("shoal rank"):
                os.kill(pid, signal.SIGKILL)
                return True
        return False

    def kill_all(self) -> None:
        for node in self.nodes.values():
            for pid in [node.pid, *descendants(node.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for node in self.nodes.values():
            node.wait()

    def wait_exited(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.nodes.values()) and time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)
        if any(p.poll() is None for p in self.nodes.values()):
            self.kill_all()


def failures(seed: int, every: float, minutes: float, n_hosts: int) -> list[tuple[float, int]]:
    """(seconds after the first step, host index) of each kill."""
    rng = random.Random(seed)
    return [(t, rng.randrange(1, n_hosts)) for t in range(int(every), int(minutes * 60), int(every))]


def run_mode(cluster, mode: str, tmp: Path, minutes: float, kills: list, replace_after: float) -> dict:
    run_dir = tmp / mode
    tmp.mkdir(parents=True, exist_ok=True)
    job = Job(cluster, mode, run_dir, tmp / f"{mode}.log")
    lighthouse = None
    try:  # the nodes end with the mode, however it ends (SIGTERM to this script included: see main)
        if mode == "torchft":
            binary = Path(sys.executable).parent / "torchft_lighthouse"
            port = job.endpoint.rpartition(":")[2]
            lighthouse = subprocess.Popen([*netns_exec(cluster.hosts[0].netns), str(binary), *LIGHTHOUSE, "--bind",
                                           f"0.0.0.0:{port}"], stderr=subprocess.STDOUT,
                                          stdout=open(tmp / f"{run_dir.name}.lighthouse.log", "w"))  # noqa: SIM115
        for i in range(len(cluster.hosts)):
            job.start(i)
        while job.poll() == 0:  # the window starts at the first step
            if all(p.poll() is not None for p in job.nodes.values()):
                sys.exit(f"{mode}: every node ended before the first step; see {tmp}/{mode}.h*.log")
            time.sleep(POLL_S)
        t0 = job.progress[0][0]
        end = t0 + minutes * 60
        events, pending, replacements, restarts = [], list(kills), [], []
        restart_at = None
        while time.time() < end:
            now = time.time() - t0
            if pending and now >= pending[0][0]:
                at, victim = pending.pop(0)
                if not job.kill_worker(victim):  # its node is still starting: no failure to inflict
                    continue
                events.append({"kill": time.time(), "host": victim, "step": job.poll()})
                if mode in ("live", "torchft"):  # the survivors go on; a replacement joins
                    replacements.append((time.time() + replace_after, victim))
                else:  # today's way: the job ends on every node; all start again once the new host is there
                    restart_at = time.time() + replace_after
            for when, host in list(replacements):
                if time.time() >= when:
                    replacements.remove((when, host))
                    job.start(host)
            if restart_at is not None and time.time() >= restart_at:
                job.wait_exited(timeout=5)  # the survivors' agents normally ended already
                restart_at = None
                restarts.append(time.time())
                for i in range(len(cluster.hosts)):
                    job.start(i, resume=True)
            job.poll()
            time.sleep(POLL_S)
        reached = job.poll()
        if restarts and job.starts[-1][0] > job.progress[-1][0]:  # restarted, not stepped yet: its checkpoint's step
            saved = [int(p.name.split("_")[-1]) for p in (run_dir / "checkpoints").glob("step_*")
                     if p.name[-1].isdigit()]
            reached = max(saved, default=0)
    finally:
        job.kill_all()
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
    return {"mode": mode, "t0": t0, "window_s": minutes * 60, "steps": reached, "events": events,
            "progress": job.progress, "starts": job.starts, "restarts": restarts, "run_dir": run_dir}


def steps_per_s(r: dict) -> float:
    """Steps per second over the window."""
    return r["steps"] / r["window_s"]


def metrics(r: dict) -> list[dict]:
    """The lines of a mode's metrics.jsonl (shoal's rank 0; torchft's replica group 0)."""
    return [json.loads(x) for x in (r["run_dir"] / "metrics.jsonl").read_text().splitlines() if x]


def samples_per_s(r: dict) -> float:
    """Useful samples per second over the window: the global batch per step of a shoal run's trajectory; for
    torchft, each committed step's participants x a replica's share (a lost replica's share is dropped)."""
    if r["mode"] != "torchft":
        return steps_per_s(r) * BATCH
    share = BATCH // 4
    lines = metrics(r)
    end = r["t0"] + r["window_s"]
    return sum(m["participants"] * share for m in lines if r["t0"] < m["time"] <= end) / r["window_s"]


def torchft_numbers(r: dict) -> dict:
    """Per failure, the survivors' stall: the gap before the first step committed without the killed
    replica (fewer participants than before the kill), less the median step; a replacement's time from its
    start to the first step committed with it (the participants back up)."""
    lines = metrics(r)
    steps = [(m["time"], m["step"], m["participants"]) for m in lines]
    step_s = statistics.median(b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False) if b[1] == a[1] + 1)
    stalls, joins = [], []
    for e in r["events"]:
        before = [s for s in steps if s[0] <= e["kill"]]
        i = next((i for i, s in enumerate(steps) if before and s[0] > e["kill"] and s[2] < before[-1][2]), None)
        if i:
            stalls.append(steps[i][0] - steps[i - 1][0] - step_s)
    for t in sorted(t for t, _ in r["starts"] if t > r["t0"]):
        before = [s for s in steps if s[0] <= t]
        grown = [s for s in steps if before and s[0] > t and s[2] > before[-1][2]]
        if grown:
            joins.append(grown[0][0] - t)
    return {"step_s": step_s, "stalls": stalls, "joins": joins}


def live_numbers(r: dict) -> dict:
    """Stall per failure, pause per join, a joiner's start-to-first-step, from rank 0's metrics. A stall is
    the time between the last step logged before the group changed and the first after, less the steps
    taken in between at the median step time (the step in flight when a worker died is redone, and its
    line may be missing when the update landed but the step's end did not)."""
    lines = metrics(r)
    steps = sorted((m["time"], m["step"]) for m in lines if "loss" in m)
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False) if b[1] == a[1] + 1]
    step_s = statistics.median(gaps)
    stalls, pauses, joins = [], [], []
    replaced = sorted(t for t, _ in r["starts"] if t > r["t0"])
    for m in lines:
        if "membership" not in m:
            continue
        before = [s for s in steps if s[0] <= m["time"]]
        after = [s for s in steps if s[0] > m["time"]]
        if not before or not after:
            continue
        (t_a, s_a), (t_b, s_b) = before[-1], after[0]
        gap = t_b - t_a - (s_b - s_a) * step_s
        (stalls if " left (" in m["membership"] else pauses).append(gap)
        started = [t for t in replaced if t < t_b]
        if " joined" in m["membership"] and started:
            joins.append(t_b - started[-1])
            replaced.remove(started[-1])
    return {"step_s": step_s, "stalls": stalls, "pauses": pauses, "joins": joins}


def restart_numbers(r: dict) -> dict:
    """Per failure: time until the run is back at the step it had when the worker died; a restarted
    job's time from start to its first step."""
    back, first = [], []
    for e in r["events"]:
        later = [t for t, s in r["progress"] if t > e["kill"] and s > e["step"]]
        if later:
            back.append(later[0] - e["kill"])
    for t in r["restarts"]:
        after = [pt for pt, _ in r["progress"] if pt > t]
        if after:
            first.append(after[0] - t)
    return {"back": back, "first": first}


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt(x: float | None, unit: str = " s") -> str:
    return f"{x:.2f}{unit}" if x is not None else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--baseline-minutes", type=float, default=1.5)
    ap.add_argument("--every", type=float, default=30.0)
    ap.add_argument("--replace-after", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the nodes and the cluster are cleaned up
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode {unknown[0]}; modes: {', '.join(MODES)}")
    if "torchft" in modes and importlib.util.find_spec("torchft") is None:
        print("torchft is not installed (.venv/bin/pip install -e '.[torchft]'): the torchft mode is left out",
              file=sys.stderr)
        modes.remove("torchft")
    up = shoal("cluster", "up", "--hosts", "4", capture_output=True)
    if up.returncode:
        print(up.stderr.strip(), file=sys.stderr)
        return 2
    runs = {}
    try:
        cluster = hosts.require_up()
        kills = failures(args.seed, args.every, args.minutes, len(cluster.hosts))
        tmp = Path(tempfile.mkdtemp(prefix="shoal-elastic-"))
        runs["failure-free"] = run_mode(cluster, "live", tmp / "ff", args.baseline_minutes, [], args.replace_after)
        print(f"failure-free: {runs['failure-free']['steps']} steps", file=sys.stderr, flush=True)
        if "torchft" in modes:  # torchft against its own failure-free run
            runs["failure-free-torchft"] = run_mode(cluster, "torchft", tmp / "ff-torchft", args.baseline_minutes, [],
                                                    args.replace_after)
        for mode in modes:
            runs[mode] = run_mode(cluster, mode, tmp, args.minutes, kills, args.replace_after)
            print(f"{mode}: {runs[mode]['steps']} steps", file=sys.stderr, flush=True)
    finally:
        shoal("cluster", "down", capture_output=True)
    return report(runs, args, kills, tmp)


def report(runs: dict, args, kills: list, tmp: Path) -> int:
    base = steps_per_s(runs["failure-free"])
    print(f"4 hosts x 1 worker (1 thread), configs/gpt-tiny.toml, global batch {BATCH}; {len(kills)} failures "
          f"planned in {args.minutes:g} min (a worker SIGKILLed every {args.every:g} s on hosts "
          f"{sorted({h for _, h in kills})}, a replacement node {args.replace_after:g} s later); failure-free: "
          f"{base * BATCH:.1f} samples/s" + (f" (torchft: {samples_per_s(runs['failure-free-torchft']):.1f})"
                                             if "failure-free-torchft" in runs else "") + f"; logs in {tmp}")
    print("| mode | failures | steps | samples/s | goodput | stall per failure | pause per join | start to first "
          "step |")
    print("|---|---|---|---|---|---|---|---|")
    result = {}
    for mode, r in runs.items():
        if mode.startswith("failure-free"):
            continue
        rate = samples_per_s(r)  # over the failure-free run of the same system
        result[mode] = rate / samples_per_s(runs["failure-free-torchft" if mode == "torchft" else "failure-free"])
        row = f"| {mode} | {len(r['events'])} | {r['steps']} | {rate:.1f} | {result[mode]:.3f} |"
        if mode == "torchft":
            n = torchft_numbers(r)
            st = med(n["stalls"])
            steps = f" ({st / n['step_s']:.1f} steps of {n['step_s'] * 1000:.0f} ms)" if st is not None else ""
            print(f"{row} {fmt(st)}{steps} | - | {fmt(med(n['joins']))} (a replacement) |")
        elif mode == "live":
            n = live_numbers(r)
            st = med(n["stalls"])
            result.update(stall_s=st, join_s=med(n["joins"]), step_s=n["step_s"], stalls=n["stalls"])
            steps = f" ({st / n['step_s']:.1f} steps)" if st is not None else ""
            print(f"{row} {fmt(st)}{steps} | {fmt(med(n['pauses']))} | {fmt(med(n['joins']))} (a joiner) |")
        else:
            n = restart_numbers(r)
            print(f"{row} {fmt(med(n['back']))} (back at the step reached) | - | {fmt(med(n['first']))} "
                  f"(a restarted job) |")
    step_s = result.get("step_s")
    if step_s:
        print(f"median step (live, 4 workers): {step_s * 1000:.0f} ms; target stall <= 2 steps = {2 * step_s:.2f} s")
        print("stall per failure, in order (s): " + " ".join(f"{x:.2f}" for x in result["stalls"]))
    good_restart = result.get("restart-30s")
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}=-" for k, v in {
        "goodput_live": result.get("live"), "goodput_restart": good_restart, "stall_s": result.get("stall_s"),
        "join_s": result.get("join_s"), "goodput_torchft": result.get("torchft")}.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

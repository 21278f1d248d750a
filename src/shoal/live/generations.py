"""A worker of a live elastic run ([Note: live membership] in membership.py): one generation of the group after
another in the same process, each formed over node 0's store, healed, and trained from where the last one
left this rank (generation.py), until the run ends, the worker leaves on a signal, or it is left out of a run
that finished.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed import PrefixStore

from shoal import dist, signals
from shoal.comm.collectives import Comm
from shoal.comm.watchdog import Watchdog
from shoal.config import Config
from shoal.live import membership
from shoal.live.connections import cut_connections, open_sockets
from shoal.live.generation import LiveGeneration, Regroup, peer_failed
from shoal.live.snapshot import heal
from shoal.preflight import Job, check_job
from shoal.rundir import choose_run_dir
from shoal.training.summary import say_done

DRAIN_S = 1.0  # how long an ended generation's failed collectives get to run their callbacks


def train_live(cfg: Config, run_dir: str | None, config_path: str | None, resume: str, joined: list) -> None:
    """This worker's part in the run, generation by generation; `joined` gets each generation's watchdog
    (for the hang report of a failure that ends the worker)."""
    member = membership.Member.from_env(evict_s=cfg.parallel.timeout_s)
    torch.set_num_threads(dist.threads_per_worker(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    from shoal.training.train import run_training  # the training stack, imported after set_num_threads

    worlds = list(range(member.min_world, member.max_world + 1))
    job = check_job(cfg, worlds, cuda=torch.cuda.is_available(), quiet=True)
    gen, held, path, events, record, live = None, None, None, [], None, None
    started, lost_at = time.perf_counter(), time.time()
    # what exists now (imported modules, the checked job) lives as long as the process: out of gc.collect()'s
    # scan at each regroup, which took ~0.1 s of it here with torch's ~300k objects in view
    gc.freeze()
    if member.current() >= 0:  # the run is going: ask the group to take this worker in
        member.request_join()
    while True:
        opened, comm = open_sockets(), None  # what this generation opens is cut when it ends
        gen = next_generation(member, gen, held)
        if gen is None:  # the run ended while this worker waited to join
            print(f"shoal: {member.where(member.id)}: the run finished before this worker could join", flush=True)
            return
        # a member of it lost from now on (before the group has formed too) cuts what this generation opened
        member.watch(gen, lambda o=opened: cut_connections(open_sockets() - o))
        try:
            env, comm, watchdog = join_generation(cfg, job, member, gen, joined)
            # every generation agrees it (a joiner learns it so); a joiner never moves the run it joins aside
            path = Path(comm.agree("run_dir", lambda p=path, fresh=gen.number == 0: str(
                p or choose_run_dir(run_dir, config_path, cfg, resume, fresh))))
            t_heal = time.perf_counter()
            healed, source = heal(comm, held, env.device, from_one=cfg.sync.mode in ("local-sgd", "diloco"))
            if gen.number > 0:
                events.append(describe_change(member, gen, source, time.time() - lost_at,
                                              time.perf_counter() - t_heal, healed.step if healed else 0))
            live = LiveGeneration(healed, regroup_wanted(member, gen, env.rank), events, record, started, opened)
            layout = job.layouts[worlds.index(env.world_size)]
            summary = run_training(cfg, layout, job.source, path, env, comm,
                                   resume=resume if gen.number == 0 else "auto", generation=live)
            break
        except Regroup as e:  # in training: its state at the step it reached
            gc.disable()  # the generation's objects become garbage from here: see leave_generation
            held, record, lost_at, live = e.snapshot, live.record, time.time(), None
        except Exception as e:  # before training began (forming the group, healing): the state it came with
            if not peer_failed(e):
                raise
            gc.disable()
            lost_at, live = time.time(), None
        if signals.requested():  # asked to stop: said before the others regroup, so none waits for it
            member.leave()
        leave_generation(member, joined, opened, comm.log if comm else None)
        if signals.requested():  # the others go on without this worker
            leave_run(member, held)
    member.watch(None)
    membership.finish(member.store)
    say_done(summary, path, cfg.train.steps, reports=env.rank == 0)
    watchdog.stop()
    member.stop()
    dist.shutdown()


def leave_generation(member, joined: list, opened: set[tuple[int, str]], log) -> None:
    """Let the ended generation go (automatic garbage collection is off since it ended): its watch and
    watchdog stopped, its connections cut (peers still waiting on this rank fail now: [Note: cutting a
    group's connections] in connections.py), the Python callbacks of its failed collectives run (`log`, its
    CollectiveLog), its group destroyed, its garbage collected."""
    member.watch(None)
    if joined:
        joined[0].stop()
    cut_connections(open_sockets() - opened)
    # freeing a gloo group whose queued work still has a Python callback to run deadlocks (its destructor
    # joins the worker thread that waits for the GIL): once they have run, the collector may free it
    settled = log is None or log.drain(DRAIN_S)
    dist.shutdown()
    if settled:
        # the old generation's model, DDP and optimizer sit in reference cycles: left to the collector, a
        # run that regrouped every 30 s got slower with each generation (steps per 30 s: 148, 122, ... 46).
        # What existed before the first generation is frozen (train_live): this scans only the generations'
        gc.collect()
    else:  # kept for the life of the process rather than risk that deadlock
        print(f"shoal: {member.where(member.id)}: a failed collective's callback did not run within {DRAIN_S:g} s; "
              "the ended generation's memory is kept", file=sys.stderr, flush=True)
        gc.freeze()
    gc.enable()


def next_generation(member, gen, held):
    """The next generation this worker is in (None: the run ended first). A worker left out of one (it
    came too late, or the group is full) asks again for the one after. A stop signal meanwhile (say, while
    too few workers are left and the rest wait for joiners): this worker leaves."""
    while True:
        got = member.regroup(gen, give_up=signals.requested)
        if signals.requested():
            leave_run(member, held)
        if got is not None or membership.is_done(member.store):
            return got
        gen = None
        member.request_join()


def leave_run(member, held) -> None:
    """This worker was asked to stop while others train on: it leaves the run (exit 128 + the signal)."""
    member.leave()  # none of the others waits for it at a regroup
    step = held.step if held is not None else 0
    print(f"shoal: {member.where(member.id)} left the run after step {step} "
          f"({signal.Signals(signals.requested()).name})", file=sys.stderr, flush=True)
    member.stop()
    raise signals.Interrupted(signals.requested(), step, None)


def join_generation(cfg: Config, job: Job, member, gen, joined: list):
    """The process group of generation `gen`, over its own store prefix; this rank's Comm and watchdog."""
    rank, world = gen.rank_of(member.id), gen.world
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # for what reads them (the hang report, reports())
    # connections of its own (cut with it when a member is lost: [Note: live membership])
    store, side = membership.connect(member.endpoint), membership.connect(member.endpoint)
    env = dist.join(job.layout.backend, cfg.parallel.timeout_s,
                    PrefixStore(gen.prefix, store), PrefixStore(gen.prefix, side), rank, world,
                    int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gen.number,
                    device=job.layout.device)
    dist.name_process(f"shoal rank {env.rank}")
    comm = Comm(env.store, env.rank, env.world_size)
    watchdog = Watchdog(comm.log, env.status_store, env.rank)
    joined[:] = [watchdog]
    signals.install()  # a signal here means: leave at the next step's end (the flags carry it)
    return env, comm, watchdog


def regroup_wanted(member, gen, rank: int):
    """This rank's wish, at each step's end, that the group change: (rank 0) a joiner waits. A rank asked
    to stop says so in the step's flags of its own (training/step.py decides when it leaves)."""

    def wanted() -> bool:
        return rank == 0 and member.join_wanted(gen)

    return wanted


def describe_change(member, gen, source: int | None, lost_s: float, heal_s: float, step: int) -> dict:
    """The change of the group that formed `gen`, as one line and its numbers."""
    before = member.generation(gen.number - 1)
    left = [m for m in before.members if m not in gen.members] if before else []
    came = [m for m in gen.members if before is None or m not in before.members]
    why = {m: (membership.EVICTED if m in gen.evicted else member.why_gone(m)) for m in left}
    parts = [f"{member.where(m)} left ({why[m]})" for m in left]
    parts += [f"{member.where(m)} joined" + (f" (healed from rank {source} in {heal_s:.2f} s)" if source is not None
                                             else "") for m in came]
    line = (f"step {step}: world {before.world if before else '?'} -> {gen.world}: {'; '.join(parts) or 'regrouped'}; "
            f"regrouped in {lost_s:.1f} s")
    return {"step": step, "time": time.time(), "generation": gen.number, "world": gen.world,
            "left": [member.where(m) for m in left], "left_ranks": [before.rank_of(m) for m in left],
            "joined": [member.where(m) for m in came],
            "why": [why[m] for m in left], "regroup_s": round(lost_s, 3), "heal_s": round(heal_s, 3),
            "healed_from": source, "line": line}

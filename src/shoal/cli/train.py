"""`shoal train`: check the config, take the nodes from the flags or the scheduler, and start the workers
(or, launched by torchrun or shoal's own launcher, be one)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from shoal.cli.options import add_launch, add_set
from shoal.errors import UserError
from shoal.launch import RESUME_COMMAND


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model from a TOML config")
    t.add_argument("config", nargs="?", help="TOML config file (defaults for every key if omitted)")
    add_set(t)
    t.set_defaults(fresh_workers=False)  # shoal.train() from Python sets it (api.py)
    t.add_argument("--run-dir", help="where results go (default: runs/<config>-<digest of what the config trains>, "
                                    "so the same command finds and continues the same run)")
    t.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto (default): continue from the run dir's newest complete checkpoint; never: start "
                        "fresh (an earlier run in the run dir is moved aside, not deleted); PATH: that checkpoint "
                        "folder")
    add_launch(t, restarts="restart the worker group this many times after a failure; it resumes from the newest "
                           "checkpoint (default 0)", nproc_default="one per GPU of this node, 1 without GPUs")


def train(args: argparse.Namespace) -> int:
    from shoal.launch import forkserver

    if forks_on_this_node(args):  # [Note: early fork server] in launch/forkserver.py
        os.environ.setdefault(RESUME_COMMAND, resume_command(args.argv))
        os.environ.update(early_worker_env(args))
        forkserver.start_early()
    try:
        from shoal.compat import require_supported_torch

        require_supported_torch()
        return train_from_here(args)
    finally:
        forkserver.stop()


def train_from_here(args: argparse.Namespace) -> int:
    from shoal import dist
    from shoal.config import load_config, resolve_auto

    cfg, chosen = resolve_auto(load_config(args.config, args.set, resolve=False))
    from shoal.live import membership

    if dist.is_launched() or membership.is_live_worker():  # we are a worker (torchrun, or our own launcher below)
        from shoal import worker

        worker.main(cfg, args.run_dir, args.config, args.resume)  # does not return
    if args.ray is not None:
        return train_on_ray(args, cfg)
    if args.cluster:
        return train_on_cluster(args)
    nodes = node_flags(args, every_gpu=cfg.parallel.device != "cpu")
    if cfg.precision.dtype != "fp32" and chosen:  # on GPUs: what the config left to the machine
        print(f"shoal: {chosen}", file=sys.stderr, flush=True)
    job, run_dir = preflight(args, cfg, nodes)
    if job is None:
        return 0
    return start(args, cfg, job, run_dir, nodes)


def early_worker_env(args: argparse.Namespace) -> dict[str, str]:
    """What the launch will add to its workers' environment for ZeRO 2/3 on CPU (tcmalloc preloaded:
    allocator.worker_env), known before the early fork server starts, so that the server starts with it and the
    workers fork from it ([Note: early fork server]). Added only once the launch had decided, it made the
    environment differ from the server's, and the launch started a second server: a one-step ZeRO 3 run of two
    workers took 5.2 s against ZeRO 0's 3.3, and 3.6 s since. Read from the config's TOML and --set without
    validating them (validating imports torch: ~1 s), on a machine without a GPU device (NVIDIA's or AMD's),
    where no worker runs on one: a guess, like forks_on_this_node's; where the validated config says otherwise,
    the launch starts another server, as it did before."""
    from shoal.allocator import tcmalloc_path, worker_env

    if tcmalloc_path() is None or any(Path("/dev").glob("nvidia*")) or Path("/dev/kfd").exists():  # CUDA, ROCm
        return {}
    from shoal.config.load import read_raw

    try:
        parallel = read_raw(args.config, args.set)[0].get("parallel", {})
    except UserError:  # said in one line once the config is loaded
        return {}
    zero, cp, device = parallel.get("zero", 0), parallel.get("cp", 1), parallel.get("device", "auto")
    if not isinstance(zero, int) or not isinstance(cp, int) or device == "cuda":
        return {}
    return worker_env(zero, cuda=False, cp=cp)[0]


def forks_on_this_node(args: argparse.Namespace) -> bool:
    """Whether, as far as the flags and the environment tell before the config is read, this command will fork
    its workers here: the `shoal` command itself (not a Python caller of it, whose process's fork server is its
    own business), not a worker (torchrun's and shoal's have LOCAL_RANK), nor Ray's or the cluster's nodes, nor
    a node of a live run (--nnodes MIN:MAX: its node launcher starts fresh interpreters). A guess the config
    proves wrong costs a server started for nothing, stopped when the command ends."""
    return (getattr(args, "command_line", False) and "LOCAL_RANK" not in os.environ and not args.fresh_workers
            and args.ray is None and not args.cluster and ":" not in (args.nnodes or ""))


def node_flags(args: argparse.Namespace, every_gpu: bool = False) -> tuple[int, int]:
    """--nnodes, --node-rank, --rdzv-endpoint and --nproc as given, or as a scheduler's environment says
    (flags win; the line printed says what was taken), checked; returns the nodes (min, max). `every_gpu`:
    without either, one worker per GPU of this node (`shoal train` of a run on GPUs, as Accelerate and
    `shoal env --check`), else 1 (torchrun's default, kept by `shoal run`: a script may be a CPU one)."""
    import torch

    from shoal.launch.environment import node_args
    from shoal.launch.restart import check_launch_args, parse_nnodes

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_gpu = gpus if every_gpu and gpus > 1 else 1
    node, taken = node_args(args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc, gpus=gpus,
                            default_nproc=per_gpu)
    if taken:
        print(taken, file=sys.stderr, flush=True)
    if args.nproc is None and per_gpu > 1 and node.nproc == per_gpu and "per node" not in (taken or ""):
        print(f"shoal: {per_gpu} workers, one per GPU of this node (--nproc N for fewer)", file=sys.stderr,
              flush=True)
    args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc = (node.nnodes, node.node_rank, node.rdzv_endpoint,
                                                                   node.nproc)
    args.started_nodes = node.started
    nodes = parse_nnodes(args.nnodes)
    check_launch_args(args.nproc, nodes, args.node_rank, args.rdzv_endpoint, args.max_restarts, args.rdzv_timeout)
    return nodes


def preflight(args: argparse.Namespace, cfg, nodes: tuple[int, int]):
    """Everything that can be checked, before any worker starts: every world size the job may take must be
    a valid layout (an asynchronous parameter server's role: the whole run's world). Returns the checked
    job and the run dir, or (None, run dir) when the run dir holds this run finished (said in one line)."""
    import torch

    from shoal.layout import check_gpus_per_node
    from shoal.preflight import check_job
    from shoal.ps import roles
    from shoal.rundir import RunDir, choose_run_dir, default_run_dir
    from shoal.training.summary import finished_message

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config, cfg)
    worlds = [roles.total_world(args.nproc * n) for n in range(nodes[0], nodes[1] + 1)]
    if nodes[0] < nodes[1]:  # a live run: any number of workers in the range (a node may lose one)
        from shoal.layout import check_live

        check_live(cfg, nodes, args.nproc)
        worlds = list(range(nodes[0] * args.nproc, nodes[1] * args.nproc + 1))
    job = check_job(cfg, worlds, cuda=torch.cuda.is_available(), run_dir=run_dir, resume=args.resume, quiet=True,
                    local_workers=args.nproc)
    check_gpus_per_node(job.layout, args.nproc, torch.cuda.device_count())
    if job.finished and RunDir(run_dir).summary.exists():
        print(finished_message(run_dir, job.resume_step, cfg.train.steps))
        return None, run_dir
    if args.node_rank == 0:
        choose_run_dir(str(run_dir), args.config, cfg, args.resume, first_attempt=True)
    return job, run_dir


def start(args: argparse.Namespace, cfg, job, run_dir: Path, nodes: tuple[int, int]) -> int:
    """The workers, through torch elastic (or an asynchronous parameter server's roles, each under an agent
    of its own: workers that come and go); returns the exit code."""
    from shoal.allocator import frees_layer_buffers, preload_for_workers
    from shoal.dist import threads_per_worker
    from shoal.launch.forkserver import PRELOAD
    from shoal.launch.restart import Forked, launch
    from shoal.ps import roles
    from shoal.worker import forked

    sets = [a for s in args.set for a in ("--set", s)]
    # a launcher that placed this node (the testbed's cluster run, a Ray driver) has set the command that
    # continues the whole job
    os.environ.setdefault(RESUME_COMMAND, resume_command(args.argv))
    # ZeRO 2/3 or cp on CPU: tcmalloc, preloaded when each worker process starts (allocator.py)
    if frees_layer_buffers(cfg.parallel.zero, cfg.parallel.cp):  # (torch is imported by the launcher only where it
        import torch  # decides something)

        preload_for_workers(cfg.parallel.zero, torch.cuda.is_available(), cfg.parallel.cp)
    if job.layout.servers and cfg.ps.mode == "async" and nodes == (1, 1) and not roles.role():
        role_argv = ["train", *([args.config] if args.config else []), *sets, "--run-dir", str(run_dir),
                     "--resume", "auto", "--nnodes", "1"]
        return roles.launch_roles(role_argv, args.nproc, job.layout.servers, args.max_restarts)
    fresh = ["-m", "shoal", "train", *([args.config] if args.config else []), *sets, "--run-dir", str(run_dir),
             "--resume", args.resume]
    if nodes[0] < nodes[1]:  # a live run: shoal's own node launcher ([Note: live membership] in live/membership.py)
        from shoal.launch.ports import free_port
        from shoal.live.node import launch_live

        return launch_live(fresh, args.nproc, nodes, args.node_rank,
                           args.rdzv_endpoint or f"127.0.0.1:{free_port()}",
                           threads_per_worker(cfg, args.nproc), args.max_restarts, args.rdzv_timeout or 600,
                           args.started_nodes)
    if args.fresh_workers:  # called from Python: fresh interpreters ([Note: forked workers])
        worker = fresh
    else:
        worker = Forked(forked, (args.config, args.set, str(run_dir), args.resume), PRELOAD)
    return launch(worker, args.nproc, nodes, args.node_rank, args.rdzv_endpoint,
                  threads=threads_per_worker(cfg, args.nproc), max_restarts=args.max_restarts,
                  rdzv_timeout=args.rdzv_timeout)


def train_on_cluster(args: argparse.Namespace) -> int:
    """`shoal train ... --cluster`: the same command, as one node per host of the cluster that is up."""
    from shoal.testbed.nodes import run

    if args.nnodes is not None or args.node_rank is not None or args.rdzv_endpoint:
        raise UserError("--cluster sets --nnodes, --node-rank and --rdzv-endpoint for each host; leave them out")
    node_argv = [a for a in args.argv if not (len(a) > 4 and "--cluster".startswith(a))]
    return run(["shoal", *node_argv], resume_command=resume_command(args.argv))


def train_on_ray(args: argparse.Namespace, cfg) -> int:
    """`shoal train ... --ray [ADDRESS]`: the same command, as one node per node of a Ray cluster
    (launch/ray_nodes.py); the working directory and the run dir must be shared by every node."""
    from shoal.launch import ray_nodes
    from shoal.rundir import default_run_dir

    nnodes = ray_nodes.launch_args(args)
    cwd = Path.cwd()
    run_dir = cwd / (Path(args.run_dir) if args.run_dir else default_run_dir(args.config, cfg))
    env = {**ray_nodes.node_env(), RESUME_COMMAND: resume_command(args.argv)}
    return ray_nodes.run(ray_nodes.without_ray(args.argv, args.ray), args.ray, nnodes, args.nproc,
                         [cwd, run_dir.parent], env, args.rdzv_timeout or 600)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the one given, without a --resume other than auto (the
    run dir it names, or the stable default it derives, holds the checkpoints)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            out.append(a)
    return shlex.join(["shoal", *out])

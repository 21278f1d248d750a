"""`shoal run [flags] script.py [args...]` (or `-m package.module`): any training script, launched as
torchrun launches it (the same worker environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*), with shoal's launcher around it: the scheduler's environment, the
namespace cluster, restarts, signals passed to every worker and the worst worker's exit code."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shoal.cli.options import add_launch
from shoal.errors import UserError


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="launch your own training script on every worker, as torchrun does",
                       description="Launch SCRIPT (or, with -m, a module) on every worker process, as torchrun "
                                   "does; everything after it is the script's own arguments.")
    add_launch(r, restarts="restart the worker group this many times after a worker fails (default 0); the "
                           "script resumes from whatever it saved, as under torchrun")
    r.add_argument("--cpu", action="store_true",
                   help="run a script written for CUDA GPUs on CPU workers, unchanged: nccl becomes gloo and "
                        "CUDA devices the CPU (src/shoal/launch/cpu.py)")
    r.add_argument("--horovod", action="store_true",
                   help="run a Horovod script unchanged: its `import horovod.torch` is shoal's Horovod API "
                        "(docs/horovod.md)")
    r.add_argument("-np", dest="np", type=int, metavar="N", help="horovodrun's number of processes (with --horovod)")
    r.add_argument("-H", dest="hosts", metavar="HOST:SLOTS,...",
                   help="horovodrun's hosts (with --horovod): this machine's, or every host of the cluster on this "
                        "machine (`shoal cluster up`); other machines run `shoal run` themselves (docs/horovod.md)")
    r.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module to run, as python -m")
    r.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    r.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    from shoal.cli.train import node_flags
    from shoal.launch.restart import launch

    if not args.module and not Path(args.script).is_file():
        raise UserError(f"script {args.script!r} does not exist (a module to run as python -m takes -m: "
                        f"shoal run -m {args.script})")
    if args.ray is not None:  # before horovodrun's flags, which place processes here or on the testbed
        return run_on_ray(args)
    if args.np is not None or args.hosts:
        horovodrun_flags(args)
    if args.cluster:
        return run_on_cluster(args)
    nodes = node_flags(args)
    worker = ["-m", "shoal.launch.script", *(["--cpu"] if args.cpu else []), *(["--horovod"] if args.horovod else []),
              *(["-m"] if args.module else []), args.script, *args.script_args]
    return launch(worker, args.nproc, nodes, args.node_rank, args.rdzv_endpoint, threads=threads(args.nproc),
                  max_restarts=args.max_restarts, rdzv_timeout=args.rdzv_timeout, worst_code=True)


def threads(nproc: int) -> int | None:
    """Intra-op threads per worker: the cores here shared among the node's workers, as `shoal train`
    does (torchrun sets 1 when it starts several); None where OMP_NUM_THREADS is already set."""
    from shoal.dist import share_of_cores

    return None if "OMP_NUM_THREADS" in os.environ else share_of_cores(nproc)


def horovodrun_flags(args: argparse.Namespace) -> None:
    """-np / -H (horovodrun's) as --nproc and --cluster (shoal/horovod/hosts.py)."""
    from shoal.horovod.hosts import placement
    from shoal.testbed import hosts

    if not args.horovod:
        raise UserError("-np and -H are horovodrun's flags: they come with --horovod (without it, give --nproc)")
    cluster = hosts.load()
    where = placement(args.np, args.hosts, args.nproc, args.cluster,
                      [(h.name, h.addr) for h in cluster.hosts] if cluster else None)
    args.nproc, args.cluster = where.nproc, where.cluster


def run_on_ray(args: argparse.Namespace) -> int:
    """`shoal run ... --ray [ADDRESS]`: the same command, as one node per node of a Ray cluster
    (launch/ray_nodes.py), in this working directory (which every node must share)."""
    from shoal.launch import ray_nodes

    nnodes = ray_nodes.launch_args(args)
    at = len(args.argv) - len(args.script_args) - 1  # the script: the flags before it are shoal's
    if args.np is not None or args.hosts:
        raise UserError("-np and -H place Horovod's processes on this machine or the cluster here; with --ray give "
                        "--nproc (workers per Ray node) and --nnodes")
    command = [*ray_nodes.without_ray(args.argv[:at], args.ray), *args.argv[at:]]
    return ray_nodes.run(command, args.ray, nnodes, args.nproc, [Path.cwd()], ray_nodes.node_env(),
                         args.rdzv_timeout or 600)


def run_on_cluster(args: argparse.Namespace) -> int:
    """`shoal run ... --cluster`: the same command, as one node per host of the cluster that is up."""
    from shoal.testbed.nodes import run as run_on_hosts

    if args.nnodes is not None or args.node_rank is not None or args.rdzv_endpoint:
        raise UserError("--cluster sets --nnodes, --node-rank and --rdzv-endpoint for each host; leave them out")
    at = len(args.argv) - len(args.script_args) - 1  # the script: the flags before it are shoal's
    flags = [a for a in args.argv[1:at] if not (len(a) > 4 and "--cluster".startswith(a))]
    if args.np is not None or args.hosts:  # resolved above: each host gets its --nproc
        from shoal.horovod.hosts import without_flags

        flags = ["--nproc", str(args.nproc), *without_flags(flags)]
    return run_on_hosts(["shoal", "run", *flags, *args.argv[at:]])

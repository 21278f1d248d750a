"""The `shoal` command. User errors become one line on stderr and exit code 2; no traceback."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from shoal.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Distributed training for PyTorch from one config.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a TOML config")
    t.add_argument("config", nargs="?", help="TOML config file (defaults for every key if omitted)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.steps=50")
    t.add_argument("--run-dir", help="where results go (default: runs/<config>-<digest of what the config trains>, "
                                    "so the same command finds and continues the same run)")
    t.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto (default): continue from the run dir's newest complete checkpoint; never: start "
                        "fresh (an earlier run in the run dir is moved aside, not deleted); PATH: that checkpoint "
                        "folder")
    t.add_argument("--nproc", type=int, help="worker processes on this node (default 1, or what the scheduler "
                                             "says: PET_NPROC_PER_NODE, SM_NUM_GPUS, SLURM_GPUS_ON_NODE)")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the worker group this many times after a failure; it resumes from the newest "
                        "checkpoint (default 0)")
    t.add_argument("--nnodes", metavar="N", help="nodes in the job (default 1, or what Slurm, a PyTorchJob or "
                                                 "SageMaker says; see `Your cluster` in the README)")
    t.add_argument("--node-rank", type=int, help="this node's rank; node 0 hosts the rendezvous (default 0, or the "
                                                 "scheduler's)")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, for multi-node jobs (default: the scheduler's)")
    t.add_argument("--rdzv-timeout", type=float, metavar="SECONDS",
                   help="how long a node waits for node 0's endpoint to answer and for the other nodes to "
                        "join (default 600, as torchrun)")
    t.add_argument("--cluster", action="store_true",
                   help="run this command as one node per host of the cluster on this machine (`shoal cluster up`), "
                        "--nproc workers each")
    c = sub.add_parser("checkpoints", help="list a run's checkpoints with step, world size, size and validity")
    rp = sub.add_parser("report", help="one self-contained HTML page of runs (loss, throughput, step time breakdown, "
                                       "memory, bytes sent, checkpoints, recoveries); several run dirs overlay")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--out", help="the page to write (default: RUN_DIR/report.html for one run, ./report.html for "
                                  "several); each figure is also written beside it as <name>-<figure>.png")
    c.add_argument("run_dir")
    e = sub.add_parser("export", help="write a checkpoint's model weights as one safetensors file, or (hf models) "
                                      "a Hugging Face directory")
    e.add_argument("run_dir")
    e.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid one)")
    e.add_argument("--out", required=True, help="output file, e.g. model.safetensors (--format hf: a new directory)")
    e.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file of the model's weights; hf: config.json + model.safetensors (LoRA "
                        "merged) + the run's tokenizer, for from_pretrained")
    p = sub.add_parser("parity", help="train two configs (two layouts of one run) side by side and compare "
                                      "their loss and gradient norm step by step")
    p.add_argument("config_a")
    p.add_argument("config_b")
    p.add_argument("--steps", type=int, default=20, help="steps to compare (default 20)")
    p.add_argument("--rtol", type=float, help="largest relative difference accepted (default: 1e-5 for fp32, "
                                              "2e-2 when either config computes in bf16, 1e-2 for fp16)")
    p.add_argument("--nproc", metavar="A,B", help='processes for each config (default: dp x tp x pp; needed when '
                                                  'parallel.dp = "auto")')
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value in both configs (repeatable)")
    j = sub.add_parser("launch", help="write the job file that runs a config on your cluster: an sbatch script, a "
                                      "Kubeflow PyTorchJob manifest or a SageMaker estimator script")
    j.add_argument("config", help="TOML config file (shipped with the job; see the README's `Your cluster`)")
    j.add_argument("--target", required=True, choices=("slurm", "kubernetes", "sagemaker"))
    j.add_argument("--nodes", type=int, required=True, help="nodes (Slurm nodes, pods, instances)")
    j.add_argument("--nproc", type=int, default=1, help="worker processes per node (default 1)")
    j.add_argument("--out", help="the file to write; - for stdout (default: <config name>.sbatch, "
                                 "<config name>-pytorchjob.yaml or <config name>_sagemaker.py here)")
    j.add_argument("--image", help="container image with shoal installed (kubernetes, sagemaker)")
    j.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node to ask for (slurm, kubernetes)")
    j.add_argument("--cpus-per-node", type=int, help="CPUs per node to ask for (slurm: default the whole node)")
    j.add_argument("--instance-type", default="ml.g5.xlarge", help="SageMaker instance type (default ml.g5.xlarge)")
    j.add_argument("--pvc", help="Kubernetes PersistentVolumeClaim for the run dirs (default: an emptyDir per pod)")
    j.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value in the job (repeatable)")
    k = sub.add_parser("cluster", help="a multi-host cluster on this machine: network namespaces with rate-limited "
                                       "links and capped CPU (root)")
    ksub = k.add_subparsers(dest="action", required=True)
    up = ksub.add_parser("up", help="make N hosts (removing any earlier cluster first)")
    up.add_argument("--hosts", type=int, required=True, help="number of hosts")
    up.add_argument("--rate", help="each host's link rate, in each direction, e.g. 100mbit (tc tbf)")
    up.add_argument("--delay", help="one-way delay between two hosts, e.g. 20ms (tc netem, if the kernel has it)")
    up.add_argument("--cpu", metavar="SHARES", help="each host's share of one core, e.g. 1,0.5 (or one for all; a "
                                                    "cgroup cpu quota)")
    ksub.add_parser("down", help="remove the cluster and everything it made")
    ksub.add_parser("status", help="list the hosts, their addresses and limits")
    r = ksub.add_parser("run", help="run a command on every host (shoal train gets --nnodes, --node-rank and "
                                    "--rdzv-endpoint), e.g. shoal cluster run -- shoal train cfg.toml --nproc 1")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    pr = sub.add_parser("probe", help="measure this machine and network (matmul FLOP/s, memory bandwidth, collective "
                                      "curves) and write the hardware profile that shoal plan reads")
    pr.add_argument("--nproc", type=int, default=1, help="processes in the group measured (default 1)")
    pr.add_argument("--cluster", action="store_true", help="one node per host of the cluster on this machine "
                                                           "(`shoal cluster up`), --nproc each")
    pr.add_argument("--out", default="profile.json", help="the profile to write (default profile.json)")
    pr.add_argument("--max-size", default="64MiB", help="largest collective message (from 4 KiB, x4; default 64MiB)")
    pr.add_argument("--repeats", type=int, default=3, help="timed repetitions per measurement (default 3)")
    pr.add_argument("--no-calibrate", action="store_true", help="skip training the reference GPT in each "
                                                                "strategy to calibrate the planner (~80 s for 2 "
                                                                "processes; not done with --cluster)")
    pr.add_argument("--nnodes-measured", type=int, default=1, help=argparse.SUPPRESS)
    pl = sub.add_parser("plan", help="predict per-rank memory and step time of every valid layout of a config "
                                     "and rank them; --check compares a finished run with its prediction")
    pl.add_argument("config", nargs="?", help="TOML config file (defaults for every key if omitted)")
    pl.add_argument("--nproc", type=int, default=1, help="processes per node (default 1)")
    pl.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    pl.add_argument("--memory", help="memory of one worker, e.g. 80GB or 16GiB: layouts above it are rejected")
    hw = pl.add_mutually_exclusive_group()
    hw.add_argument("--hardware", metavar="PROFILE.json", help="a profile written by shoal probe")
    hw.add_argument("--preset", help="a data-sheet profile: h100, h200, a100 (no collective curves)")
    pl.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value (repeatable)")
    pl.add_argument("--top", type=int, default=15, help="valid layouts shown (default 15)")
    pl.add_argument("--apply", metavar="OUT.toml", help="write the best layout into a copy of the config")
    pl.add_argument("--check", metavar="RUN_DIR", help="compare a finished run with the prediction for its layout")
    return parser


def probe(args: argparse.Namespace) -> int:
    from shoal import dist
    from shoal import probe as probing
    from shoal.plan.planner import parse_bytes

    sizes = probing.sizes_up_to(parse_bytes(args.max_size, "--max-size"))
    if args.nproc < 1 or args.repeats < 1:
        raise UserError("--nproc and --repeats must be >= 1")
    if dist.is_launched():
        probing.worker(args.out, sizes, args.repeats, args.nnodes_measured)
        return 0
    if args.cluster:
        from shoal.cluster.run import run

        return run(["shoal", *[a for a in args.argv if a != "--cluster"]])
    code = probing.launch_probe([a for a in args.argv[1:] if a not in ("--cluster", "--no-calibrate")], args.nproc)
    if code == 0 and not args.no_calibrate:
        probing.calibrate_profile(args.out, args.nproc)
    return code


def plan(args: argparse.Namespace) -> int:
    from shoal.config import load_config
    from shoal.hardware import load_profile, preset
    from shoal.plan import check as checking
    from shoal.plan import planner, report

    profile = load_profile(args.hardware) if args.hardware else preset(args.preset) if args.preset else None
    memory = planner.parse_bytes(args.memory, "--memory") if args.memory else None
    if args.check:
        rows = checking.check_run(args.check, profile)
        for name, predicted, measured, err in rows:
            fmt = (lambda v: "?" if v is None else f"{v:.4g}") if "time" in name else (
                lambda v: "?" if v is None else planner.human_bytes(v))
            rel = "?" if err is None else f"{err:+.1%}"
            print(f"{name:22s} predicted {fmt(predicted):>12s}  measured {fmt(measured):>12s}  error {rel}")
        return 0
    if args.nproc < 1 or args.nnodes < 1:
        raise UserError("--nproc and --nnodes must be >= 1")
    cfg = load_config(args.config, args.set)
    planned = planner.plan(cfg, args.nproc * args.nnodes, profile, memory)
    report.render(planned, args.top)
    if args.apply:
        best = report.apply(args.config, planned, args.apply)
        print(f"wrote {args.apply}: {best.candidate.label()}")
    return 0


def checkpoints(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from shoal.checkpoint.export import table_rows

    rows = table_rows(Path(args.run_dir))
    table = Table("step", "world size", "size", "saved at", "status", title=f"checkpoints of {args.run_dir}")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console.width = 200  # a pipe or a log file: do not wrap the problem text
    console.print(table if rows else f"no checkpoints in {args.run_dir}")
    return 0


def report(args: argparse.Namespace) -> int:
    from shoal.report.page import render

    runs = [Path(p) for p in args.run_dirs]
    out = Path(args.out) if args.out else report_path(runs)
    written = render(runs, out)
    if not args.out and len(runs) > 1:
        print(f"several runs: the page goes to the current directory ({out}); --out chooses another place")
    print(f"wrote {written[0]} ({len(written) - 1} figures, also as PNG files beside it)")
    return 0


def report_path(runs: list[Path]) -> Path:
    """Where `shoal report` writes without --out: into the run dir of one run (a report is part of that
    run's results); for several, which belong to no one run, the current directory."""
    return runs[0] / "report.html" if len(runs) == 1 else Path("report.html")


def export(args: argparse.Namespace) -> int:
    from shoal.checkpoint.export import export_hf, export_weights

    ckpt = (export_hf if args.format == "hf" else export_weights)(Path(args.run_dir), Path(args.out), args.step)
    what = "a Hugging Face model directory" if args.format == "hf" else "model weights"
    print(f"wrote {args.out}: {what} of {ckpt.path} (step {ckpt.step})")
    return 0


def train(args: argparse.Namespace) -> int:
    from shoal import dist
    from shoal.config import load_config

    cfg = load_config(args.config, args.set)
    if dist.is_launched():  # we are a worker (torchrun, or our own launcher below)
        from shoal import worker

        worker.main(cfg, args.run_dir, args.config, args.resume)  # does not return
    if args.cluster:
        return train_on_cluster(args)
    import torch

    from shoal.cluster.environment import node_args

    # flags win; what a scheduler's environment says fills the rest, and the line says what it was
    node, taken = node_args(args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc,
                            gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if taken:
        print(taken, file=sys.stderr, flush=True)
    args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc = (node.nnodes, node.node_rank, node.rdzv_endpoint,
                                                                   node.nproc)

    from shoal.launch import check_launch_args, launch, parse_nnodes
    from shoal.preflight import check_job
    from shoal.ps import roles
    from shoal.rundir import RunDir, default_run_dir
    from shoal.worker import RESUME_COMMAND, choose_run_dir, finished_message, threads_per_worker

    nodes = parse_nnodes(args.nnodes)
    check_launch_args(args.nproc, nodes, args.node_rank, args.rdzv_endpoint, args.max_restarts, args.rdzv_timeout)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config, cfg)
    # every world size the job may take must be a valid layout; everything that can be checked is,
    # before any worker starts (a parameter server's role: the whole run's world)
    worlds = [roles.total_world(args.nproc * n) for n in range(nodes[0], nodes[1] + 1)]
    job = check_job(cfg, worlds, cuda=torch.cuda.is_available(), run_dir=run_dir, resume=args.resume, quiet=True)
    if job.finished and RunDir(run_dir).summary.exists():
        print(finished_message(run_dir, job.resume_step, cfg.train.steps))
        return 0
    if args.node_rank == 0:
        choose_run_dir(str(run_dir), args.config, cfg, args.resume, first_attempt=True)
    worker_argv = ["-m", "shoal", "train", *([args.config] if args.config else []),
                   *[a for s in args.set for a in ("--set", s)], "--run-dir", str(run_dir), "--resume", args.resume]
    from shoal.cluster.run import NODE_ENV

    if NODE_ENV not in os.environ:  # on a cluster's host, the cluster run set the command that continues it
        os.environ[RESUME_COMMAND] = resume_command(args.argv)
    if job.layout.servers and cfg.ps.mode == "async" and nodes == (1, 1) and not roles.role():
        # workers that come and go: each role under an agent of its own (ps/roles.py)
        role_argv = ["train", *([args.config] if args.config else []), *[a for s in args.set for a in ("--set", s)],
                     "--run-dir", str(run_dir), "--resume", "auto", "--nnodes", "1"]
        return roles.launch_roles(role_argv, args.nproc, job.layout.servers, args.max_restarts)
    return launch(worker_argv, args.nproc, nodes, args.node_rank, args.rdzv_endpoint,
                  threads=threads_per_worker(cfg, args.nproc), max_restarts=args.max_restarts,
                  rdzv_timeout=args.rdzv_timeout)


def train_on_cluster(args: argparse.Namespace) -> int:
    """`shoal train ... --cluster`: the same command, as one node per host of the cluster that is up."""
    from shoal.cluster.run import run

    if args.nnodes is not None or args.node_rank is not None or args.rdzv_endpoint:
        raise UserError("--cluster sets --nnodes, --node-rank and --rdzv-endpoint for each host; leave them out")
    node_argv = [a for a in args.argv if not (len(a) > 4 and "--cluster".startswith(a))]
    return run(["shoal", *node_argv], resume_command=resume_command(args.argv))


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


def parity(args: argparse.Namespace) -> int:
    from shoal.parity import parity as run_parity

    nprocs = (None, None)
    if args.nproc:
        try:
            a, b = (int(x) for x in args.nproc.split(","))
        except ValueError:
            raise UserError(f"--nproc {args.nproc!r}: expected two numbers A,B, for example --nproc 1,2") from None
        if min(a, b) < 1:
            raise UserError(f"--nproc {args.nproc}: both must be >= 1")
        nprocs = (a, b)
    return run_parity(args.config_a, args.config_b, args.steps, args.rtol, nprocs, args.set)


def launch_job(args: argparse.Namespace) -> int:
    """`shoal launch`: write the job file for a scheduler (cluster/jobs.py)."""
    from shoal.cluster import jobs

    config = Path(args.config)
    if not config.is_file():
        raise UserError(f"config file {config} does not exist; pass the path of a .toml file")
    spec = jobs.JobSpec(args.target, args.config, config.read_text(encoding="utf-8"), tuple(args.set), args.nodes,
                        args.nproc, args.image, args.gpus_per_node, args.cpus_per_node, args.instance_type, args.pvc)
    jobs.check(spec)
    text = jobs.render(spec)
    if args.out == "-":
        print(text, end="")
        return 0
    out = Path(args.out) if args.out else jobs.default_out(spec)
    out.write_text(text, encoding="utf-8")
    if args.target == "slurm":
        out.chmod(0o755)
    print(f"wrote {out}: {args.nodes} node(s) x {args.nproc} worker(s) of {args.config}; {jobs.how_to_run(spec, out)}")
    return 0


def cluster(args: argparse.Namespace) -> int:
    from shoal.cluster import hosts
    from shoal.cluster.system import require_root

    if args.action == "status":
        print(hosts.status_text(hosts.load()))
        return 0
    if args.action == "run":
        from shoal.cluster.run import run

        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return run(command, resume_command=resume_command(args.argv))
    require_root(args.action)
    if args.action == "down":
        removed = hosts.down()
        print(f"removed {', '.join(removed)}" if removed else "no cluster to remove")
        return 0
    print(hosts.status_text(hosts.up(args.hosts, args.rate, args.delay, args.cpu)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return {"train": train, "checkpoints": checkpoints, "export": export, "parity": parity,
                "cluster": cluster, "launch": launch_job, "report": report, "probe": probe,
                "plan": plan}[args.command](args)
    except UserError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

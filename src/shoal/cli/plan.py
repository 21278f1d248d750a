"""`shoal probe` (measure this machine) and `shoal plan` (predict every layout of a config)."""

from __future__ import annotations

import argparse

from shoal.cli.options import add_set
from shoal.errors import UserError


def add_parsers(sub) -> None:
    pr = sub.add_parser("probe", help="measure this machine and network (matmul FLOP/s, memory bandwidth, collective "
                                      "curves) and write the hardware profile that shoal plan reads")
    pr.add_argument("--nproc", type=int, default=1, help="processes in the group measured (default 1)")
    pr.add_argument("--cluster", action="store_true", help="one node per host of the cluster on this machine "
                                                           "(`shoal cluster up`), --nproc each")
    pr.add_argument("--out", default="profile.json", help="the profile to write (default profile.json)")
    pr.add_argument("--max-size", default="64MiB", help="largest collective message (from 4 KiB, x4; default 64MiB)")
    pr.add_argument("--repeats", type=int, default=3, help="timed repetitions per measurement (default 3)")
    pr.add_argument("--no-calibrate", action="store_true", help="skip training the reference GPT in each "
                                                                "strategy to calibrate the planner (~4 min for 2 "
                                                                "processes; not done with --cluster)")
    pr.add_argument("--force-calibration", action="store_true", help="calibrate even where other processes took "
                    "more than the probe allows of the CPU time while it measured (see docs/planner.md)")
    pr.add_argument("--nnodes-measured", type=int, default=1, help=argparse.SUPPRESS)
    pr.add_argument("--spot", action="store_true", help=argparse.SUPPRESS)  # plan's own quick measurement
    pl = sub.add_parser("plan", help="predict per-rank memory and step time of every valid layout of a config "
                                     "and rank them; --check compares a finished run with its prediction")
    pl.add_argument("config", nargs="?", help="TOML config file (defaults for every key if omitted)")
    pl.add_argument("--nproc", type=int, default=1, help="processes per node (default 1)")
    pl.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    pl.add_argument("--memory", help="memory of one worker, e.g. 80GB or 16GiB: layouts above it are rejected")
    hw = pl.add_mutually_exclusive_group()
    hw.add_argument("--hardware", metavar="PROFILE.json", help="a profile written by shoal probe (default: this "
                    "machine's, cached by shoal probe, or measured on the spot; used even if measured elsewhere)")
    hw.add_argument("--preset", help="a data-sheet profile with its cluster's network: h100, h200, a100, or a named "
                                     "cluster such as h100-ib400, h100-roce400, a100-ib200, a100-efa400; see "
                                     "docs/planner.md")
    pl.add_argument("--network", help="a preset's network instead of its own: nvlink4-ndr400 (H100/H200 HGX on "
                    "InfiniBand NDR), nvlink4-roce400, nvlink4-eth100, nvlink3-hdr200 (A100 HGX on HDR), "
                    "nvlink3-efa400, nvlink3-opa400; see docs/planner.md")
    add_set(pl)
    pl.add_argument("--expert-imbalance", type=float, default=1.0, metavar="X",
                    help="a mixture of experts under parallel.ep: the most tokens a rank's experts take over the "
                         "mean, priced in its step and its memory (an ep run's summary.json "
                         "profile.median_ep_imbalance; default 1.0, balanced)")
    pl.add_argument("--top", type=int, default=15, help="valid layouts shown (default 15)")
    pl.add_argument("--apply", metavar="OUT.toml", help="write the best layout into a copy of the config")
    pl.add_argument("--check", metavar="RUN_DIR", help="compare a finished run with the prediction for its layout")


def probe(args: argparse.Namespace) -> int:
    from shoal import dist
    from shoal.plan import probe as probing
    from shoal.plan.planner import parse_bytes

    sizes = probing.sizes_up_to(parse_bytes(args.max_size, "--max-size"))
    if args.nproc < 1 or args.repeats < 1:
        raise UserError("--nproc and --repeats must be >= 1")
    if dist.is_launched():
        probing.worker(args.out, sizes, args.repeats, args.nnodes_measured, args.spot)
        return 0
    if args.cluster:
        from shoal.testbed.nodes import run

        return run(["shoal", *[a for a in args.argv if a != "--cluster"]])
    from shoal.plan.calibrate import OtherCpu

    others = OtherCpu()  # what other processes take of the CPUs while the probe measures
    code = probing.launch_probe([a for a in args.argv[1:] if a not in ("--cluster", "--no-calibrate",
                                                                        "--force-calibration")], args.nproc)
    if code == 0 and not args.no_calibrate:
        probing.calibrate_profile(args.out, args.nproc, others.share(), args.force_calibration)
    if code == 0:
        from shoal.hardware import load_profile
        from shoal.plan.profiles import store

        kept = store(load_profile(args.out))
        if kept:
            print(f"kept in {kept}: shoal plan --nproc {args.nproc} on this machine uses it", flush=True)
    return code


def plan(args: argparse.Namespace) -> int:
    from shoal.config import load_config
    from shoal.models.spec import count_parameters
    from shoal.plan import check as checking
    from shoal.plan import planner, report

    if args.network and not args.preset:
        raise UserError(f"--network {args.network}: a network prices a preset's collectives; give --preset too "
                        "(a probe's profile has its own measured curves)")
    if args.nproc < 1 or args.nnodes < 1:
        raise UserError("--nproc and --nnodes must be >= 1")
    if args.expert_imbalance < 1.0:
        raise UserError(f"--expert-imbalance {args.expert_imbalance:g}: the most any experts take over the mean is at "
                        f"least 1 (1.0: balanced)")
    memory = planner.parse_bytes(args.memory, "--memory") if args.memory else None
    cfg = None if args.check else load_config(args.config, args.set)  # a bad config is said before measuring
    profile, line, missing = _profile(args)
    print(line, flush=True)
    if args.check:
        rows = checking.check_run(args.check, profile)
        for name, predicted, measured, err in rows:
            fmt = (lambda v: "?" if v is None else f"{v:.4g}") if "time" in name else (
                lambda v: "?" if v is None else planner.human_bytes(v))
            rel = "?" if err is None else f"{err:+.1%}"
            print(f"{name:22s} predicted {fmt(predicted):>12s}  measured {fmt(measured):>12s}  error {rel}")
        if checking.is_session_run(args.check):
            print("a Session's run: its forward and loss are the script's own, which the planner does not trace; "
                  "model state is predicted, step time and peak are not (?)")
        return 0
    model = planner.Model.build(cfg)
    print(f"model {cfg.model.name}: {model.bundle.params_text(count_parameters(model.bundle.model))}")
    planned = planner.plan(cfg, args.nproc * args.nnodes, profile, memory, imbalance=args.expert_imbalance,
                           model=model)
    report.render(planned, args.top, missing=missing)
    if args.apply:
        best = report.apply(args.config, planned, args.apply)
        print(f"wrote {args.apply}: {best.candidate.label()}")
    return 0


def _profile(args: argparse.Namespace):
    """(profile or None, the line saying which, what would fill in missing step times): --hardware as
    given, a preset priced for this job's nodes, or this machine's own (plan/profiles.py: cached, else
    measured on the spot; --check measures nothing)."""
    from shoal.hardware import preset
    from shoal.plan import profiles

    probe = f"run `{profiles.probe_command(args.nproc, args.nnodes)}` on the machines (later plans there use " \
            f"its profile), or plan with --preset"
    if args.hardware:
        chosen = profiles.forced(args.hardware)
        return chosen.profile, chosen.line, probe
    if args.preset:  # its collectives priced for this job's nodes (plan/network.py)
        from shoal.plan.network import network

        profile = preset(args.preset)
        name = network(args.network).name if args.network else profile.network
        profile = profile.model_copy(update={"network": name, "nproc": args.nproc, "nnodes": args.nnodes})
        return profile, f"profile: preset {args.preset} ({profile.device_name}; network {name})", probe
    chosen = profiles.choose(args.nproc, args.nnodes, measure=not args.check)
    return chosen.profile, chosen.line, probe

"""Where a job runs: `shoal launch` (a scheduler's job file) and `shoal cluster` (hosts in network
namespaces on this machine, the testbed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.cli.options import add_set
from shoal.cli.train import resume_command
from shoal.errors import UserError


def add_parsers(sub) -> None:
    add_launch_parser(sub)
    add_cluster_parser(sub)


def add_launch_parser(sub) -> None:
    j = sub.add_parser("launch", help="write the job file that runs a config on your cluster: an sbatch script, a "
                                      "Kubeflow PyTorchJob manifest, a SageMaker script, an Azure ML command job or a "
                                      "Vertex AI CustomJob spec")
    j.add_argument("config", help="TOML config file (shipped with the job; see docs/your-cluster.md)")
    # checked by shoal launch itself (launch/jobs.py), so that an unknown one is one line
    j.add_argument("--target", required=True, help="slurm, kubernetes, sagemaker, azureml or vertex")
    j.add_argument("--nodes", required=True, help="nodes (Slurm nodes, pods, instances); slurm and kubernetes also "
                   "take a range MIN:MAX, a job that runs live (docs/elastic.md)")
    j.add_argument("--nproc", type=int, default=1, help="worker processes per node (default 1)")
    j.add_argument("--out", help="the file to write; - for stdout (default: <config name>.sbatch, "
                                 "<config name>-pytorchjob.yaml, _sagemaker.py, -azureml.yaml or -vertex.yaml here)")
    j.add_argument("--image", help="container image with shoal installed (needed by all but slurm; on slurm, "
                                  "srun runs the task in it through pyxis: --container-image)")
    j.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node to ask for (slurm, kubernetes, vertex)")
    j.add_argument("--cpus-per-node", type=int, help="CPUs per node to ask for (slurm: default the whole node)")
    j.add_argument("--instance-type", help="SageMaker instance type (default ml.g5.xlarge) or Vertex AI machine type "
                   "(default n1-standard-8)")
    j.add_argument("--compute", help="Azure ML compute cluster (azureml)")
    j.add_argument("--accelerator", help="Vertex AI accelerator type with --gpus-per-node, e.g. NVIDIA_L4 (vertex)")
    j.add_argument("--output", help="Vertex AI base output directory gs://BUCKET/PATH, where the run dir goes (vertex)")
    j.add_argument("--pvc", help="Kubernetes PersistentVolumeClaim for the run dirs (default: an emptyDir per pod)")
    j.add_argument("--nccl-ifname", metavar="IFACE", help="NCCL_SOCKET_IFNAME in the job: the network interface NCCL "
                   "bootstraps over (and carries traffic on without InfiniBand), e.g. eth0 or ^docker,lo")
    j.add_argument("--nccl-ib-hca", metavar="HCAS", help="NCCL_IB_HCA in the job: the InfiniBand / RoCE adapters NCCL "
                   "uses, e.g. mlx5 or =mlx5_0:1,mlx5_1:1")
    j.add_argument("--preset", default="h100", help="the GPU whose data sheet prices HSDP against ZeRO over every rank "
                   "for several GPU nodes (h100, h200, a100; default h100)")
    j.add_argument("--network", help="its cluster's network for that price (default the preset's; shoal plan --help "
                   "lists them)")
    add_set(j, "override a config value in the job (repeatable)")


def add_cluster_parser(sub) -> None:
    k = sub.add_parser("cluster", help="a multi-host cluster on this machine: network namespaces with rate-limited "
                                       "links and capped CPU (root)")
    ksub = k.add_subparsers(dest="action", required=True)
    up = ksub.add_parser("up", help="make N hosts (removing any earlier cluster first)")
    up.add_argument("--hosts", type=int, required=True, help="number of hosts")
    up.add_argument("--rate", help="each host's link rate, in each direction, e.g. 100mbit (tc tbf)")
    up.add_argument("--delay", help="one-way delay between two hosts, e.g. 20ms (tc netem, if the kernel has it)")
    up.add_argument("--cpu", metavar="SHARES", help="each host's share of one core, e.g. 1,0.5 (or one for all; a "
                                                    "cgroup cpu quota)")
    up.add_argument("--slurm", action="store_true", help="also start Slurm on the hosts (munge, slurmctld on h0, a "
                                                         "slurmd per host): a real scheduler to submit job files to")
    up.add_argument("--ray", action="store_true", help="also start a Ray cluster on the hosts (the head on h0, a node "
                                                       "per host): a real Ray to run `shoal train --ray` on")
    ksub.add_parser("down", help="remove the cluster and everything it made")
    ksub.add_parser("status", help="list the hosts, their addresses and limits")
    r = ksub.add_parser("run", help="run a command on every host (shoal train gets --nnodes, --node-rank and "
                                    "--rdzv-endpoint), e.g. shoal cluster run -- shoal train cfg.toml --nproc 1")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def launch_job(args: argparse.Namespace) -> int:
    """`shoal launch`: write the job file for a scheduler (launch/jobs.py)."""
    from shoal.launch import jobs

    config = Path(args.config)
    if not config.is_file():
        raise UserError(f"config file {config} does not exist; pass the path of a .toml file")
    least, nodes = jobs.parse_nodes(args.nodes)
    env = tuple((k, v) for k, v in (("NCCL_SOCKET_IFNAME", args.nccl_ifname), ("NCCL_IB_HCA", args.nccl_ib_hca)) if v)
    spec = jobs.JobSpec(args.target, args.config, config.read_text(encoding="utf-8"), tuple(args.set), nodes,
                        args.nproc, args.image, args.gpus_per_node, args.cpus_per_node, args.instance_type, args.pvc,
                        min_nodes=least, compute=args.compute, accelerator=args.accelerator, output=args.output,
                        env=env)
    jobs.check(spec)
    if args.gpus_per_node and least is None and nodes > 1:  # several GPU nodes: HSDP where the plan says faster
        from dataclasses import replace

        from shoal.config import load_config
        from shoal.plan.hsdp import hsdp_choice

        choice = hsdp_choice(load_config(args.config, list(args.set), resolve=False), nodes, args.nproc, args.preset,
                             args.network)
        if choice is not None:
            print(f"shoal launch: {choice.line(nodes)}")
            if choice.replicate > 1:
                spec = replace(spec, sets=(*spec.sets, f"parallel.dp_replicate={choice.replicate}"))
    out = Path(args.out) if args.out not in (None, "-") else jobs.default_out(spec)
    text = jobs.render(spec, out.parent)
    if args.out == "-":
        print(text, end="")
        return 0
    out.write_text(text, encoding="utf-8")
    if args.target == "slurm":
        out.chmod(0o755)
    print(f"wrote {out}: {args.nodes} node(s) x {args.nproc} worker(s) of {args.config}; {jobs.how_to_run(spec, out)}")
    return 0


def cluster(args: argparse.Namespace) -> int:
    from shoal.testbed import hosts
    from shoal.testbed.system import require_root

    if args.action == "status":
        print(hosts.status_text(hosts.load()))
        return 0
    if args.action == "run":
        from shoal.testbed.nodes import run

        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return run(command, resume_command=resume_command(args.argv))
    require_root(args.action)
    if args.action == "down":
        removed = hosts.down()
        print(f"removed {', '.join(removed)}" if removed else "no cluster to remove")
        return 0
    from shoal.testbed import ray, slurm

    if args.slurm:
        slurm.require_slurm()
    if args.ray:
        ray.require_ray()
    made = hosts.up(args.hosts, args.rate, args.delay, args.cpu)
    if args.slurm:
        slurm.up(made)
    if args.ray:
        ray.up(made)
    print(hosts.status_text(made))
    return 0

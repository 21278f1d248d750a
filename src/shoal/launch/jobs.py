"""`shoal launch`: the job file that runs a config on a scheduler, for N nodes of M workers each.

  slurm       an sbatch script: N nodes, one task per node, `srun shoal train CONFIG --nproc M`; each
              task reads its node rank and node 0's address from Slurm (launch/environment.py). The
              config is read where the job is submitted from (a filesystem every node sees), and the
              stable default run dir there is where a requeued job finds its checkpoints. For a range
              MIN:MAX: `--nodes=MIN-MAX` (Slurm starts it on as many as are free), --no-kill and srun
              --kill-on-bad-exit=0 (a lost node leaves the job running), and `--nnodes MIN:MAX`: live.
              Slurm adds no node to a running job, so such a job shrinks and never grows
  kubernetes  a Kubeflow PyTorchJob (Master 1 + Worker N-1, containers named "pytorch" as the operator
              requires) and a ConfigMap carrying the config's text, mounted into every pod; runs go to a
              volume (a PersistentVolumeClaim, or an emptyDir that outlives a container restart). For a
              range MIN:MAX: MAX Workers and an elasticPolicy; each pod's shoal then runs live, node 0 on
              <job>-worker-0 (launch/environment.py)
  sagemaker   a Python script that submits a sagemaker.pytorch.PyTorch estimator (instance_count N) and
              is also its entry point: on each instance it runs `shoal train`, which reads SM_HOSTS; the
              config travels beside it in the job's source_dir

Every file starts `shoal train` with the config and the --set overrides given here, checked before
the file is written (the config loads, and its layout fits N x M processes).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from shoal.config import load_config
from shoal.errors import UserError, require
from shoal.layout import check_live, resolve_layout

TARGETS = ("slurm", "kubernetes", "sagemaker")
CONFIG_DIR = "/etc/shoal"  # where a PyTorchJob's pods see the config (the ConfigMap's mount)
RUNS_DIR = "/runs"  # a PyTorchJob's run dirs (its volume)
MASTER_PORT = 23456  # the PyTorchJob operator's default port; it sets MASTER_PORT from the named container port
SAGEMAKER_RUNS = "/opt/ml/checkpoints"  # SageMaker copies it to and from checkpoint_s3_uri when one is given


@dataclass(frozen=True)
class JobSpec:
    target: str
    config: str  # the path as given, relative to where the job is submitted
    config_text: str
    sets: tuple[str, ...]
    nodes: int
    nproc: int
    image: str | None = None
    gpus_per_node: int = 0
    cpus_per_node: int | None = None
    instance_type: str = "ml.g5.xlarge"
    pvc: str | None = None
    min_nodes: int | None = None  # a range min_nodes:nodes (an elastic PyTorchJob); None: exactly `nodes`

    @property
    def stem(self) -> str:
        return Path(self.config).stem

    @property
    def name(self) -> str:
        """A job name Kubernetes accepts in every pod and service name it derives (DNS-1123, short)."""
        return ("shoal-" + re.sub(r"[^a-z0-9-]+", "-", self.stem.lower())).strip("-")[:40].rstrip("-")

    def train_argv(self, config: str, run_dir: str | None = None) -> list[str]:
        return ["shoal", "train", config, "--nproc", str(self.nproc), *(["--run-dir", run_dir] if run_dir else []),
                *[a for s in self.sets for a in ("--set", s)]]


def parse_nodes(text: str) -> tuple[int | None, int]:
    """--nodes: N as (None, N), or a range MIN:MAX as (MIN, MAX)."""
    lo, colon, hi = text.partition(":")
    try:
        least, most = (int(lo), int(hi)) if colon else (int(text), int(text))
    except ValueError:
        raise UserError(f"--nodes {text!r}: expected a number of nodes, or for --target slurm or kubernetes a "
                        f"range MIN:MAX (--nodes 2, --nodes 1:4)") from None
    if least > most:
        raise UserError(f"--nodes {text}: MIN ({least}) is above MAX ({most}); give --nodes {most}:{least}")
    return (least if least < most else None), most


def check(spec: JobSpec) -> None:
    """Refuse, in one line, a job that could not run: before it waits in a queue."""
    if spec.target not in TARGETS:
        raise UserError(f"--target {spec.target}: expected one of {', '.join(TARGETS)}")
    if min(spec.nodes, spec.min_nodes or spec.nodes) < 1:
        raise UserError(f"--nodes ({spec.min_nodes or spec.nodes}) must be >= 1")
    if spec.nproc < 1:
        raise UserError(f"--nproc ({spec.nproc}) must be >= 1")
    if spec.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node ({spec.gpus_per_node}) must be >= 0")
    if spec.cpus_per_node is not None and spec.cpus_per_node < 1:
        raise UserError(f"--cpus-per-node ({spec.cpus_per_node}) must be >= 1")
    if spec.gpus_per_node and spec.nproc > spec.gpus_per_node:
        raise UserError(f"--nproc {spec.nproc} workers per node but --gpus-per-node {spec.gpus_per_node}: each GPU "
                        f"worker needs its own GPU; give --nproc {spec.gpus_per_node} or more GPUs")
    if spec.target in ("kubernetes", "sagemaker") and not spec.image:
        raise UserError(f"--target {spec.target} needs --image IMAGE: a container image with shoal installed "
                        f"(and the data the config reads)")
    if spec.pvc and spec.target != "kubernetes":
        raise UserError("--pvc names a Kubernetes PersistentVolumeClaim; it is for --target kubernetes")
    if spec.min_nodes is not None and spec.target == "sagemaker":
        raise UserError(f"--nodes {spec.min_nodes}:{spec.nodes}: a SageMaker job's instance count is fixed when it "
                        f"is submitted: give --nodes N (a range is for --target slurm or kubernetes)")
    cfg = load_config(spec.config, list(spec.sets))
    cuda = spec.gpus_per_node > 0 or (spec.target == "sagemaker" and spec.instance_type.startswith(("ml.p", "ml.g")))
    if spec.min_nodes is not None:  # every world the range allows, and a layout that heals live
        check_live(cfg, (spec.min_nodes, spec.nodes), spec.nproc)
    for nodes in range(spec.min_nodes or spec.nodes, spec.nodes + 1):
        resolve_layout(cfg, nodes * spec.nproc, cuda)  # its UserError names the keys and a value that works


def render(spec: JobSpec) -> str:
    return {"slurm": sbatch_script, "kubernetes": pytorchjob_manifest, "sagemaker": sagemaker_script}[spec.target](spec)


def default_out(spec: JobSpec) -> Path:
    return Path({"slurm": f"{spec.stem}.sbatch", "kubernetes": f"{spec.stem}-pytorchjob.yaml",
                 "sagemaker": f"{spec.stem}_sagemaker.py"}[spec.target])


def how_to_run(spec: JobSpec, out: str) -> str:
    """What the user does with the file, and how the config travels with the job."""
    if spec.target == "slurm":
        return (f"submit it with `sbatch {out}` from this directory: every node reads {spec.config} here (a "
                f"filesystem all nodes see), and the same script resumes after a requeue")
    if spec.target == "kubernetes":
        return (f"start it with `kubectl apply -f {out}`: the config travels in the ConfigMap {spec.name}-config "
                f"(mounted at {CONFIG_DIR}); the image {spec.image} must hold shoal and the data the config reads")
    return (f"submit it with `python {out}` (the sagemaker package and AWS credentials; SAGEMAKER_ROLE names the "
            f"IAM role): {spec.config} is shipped beside it in the job's source_dir")


def sbatch_script(spec: JobSpec) -> str:
    live = spec.min_nodes is not None
    nodes = f"{spec.min_nodes} to {spec.nodes}" if live else str(spec.nodes)
    train = [*spec.train_argv(spec.config), *(["--nnodes", f"{spec.min_nodes}:{spec.nodes}", "--max-restarts", "3"]
                                              if live else [])]
    cpus = (f"#SBATCH --cpus-per-task={spec.cpus_per_node}" if spec.cpus_per_node else
            "#SBATCH --exclusive                    # the one task per node gets the whole node")
    if live:  # no --ntasks-per-node: with it, Slurm 22.05 gives a range MIN nodes with MAX free (measured)
        size = [f"#SBATCH --nodes={spec.min_nodes}-{spec.nodes}".ljust(39) + "# as many as are free, within the range",
                "#SBATCH --no-kill                      # a node that fails leaves the job running on the others"]
    else:
        size = [f"#SBATCH --nodes={spec.nodes}",
                "#SBATCH --ntasks-per-node=1            # one shoal per node; it starts --nproc workers itself"]
    lines = [
        "#!/bin/bash",
        f"# {spec.config} on {nodes} node(s) x {spec.nproc} worker(s), written by `shoal launch --target slurm`.",
        "# Submit from the directory holding the config (a filesystem every node sees): sbatch THIS_FILE.",
        "# Add --partition, --account or --time as your cluster asks.",
        f"#SBATCH --job-name={spec.name}",
        *size,
        cpus,
        *([f"#SBATCH --gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []),
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --requeue                      # the same command resumes from the newest checkpoint",
        "set -euo pipefail",
        "",
        "# Each task reads the node count, its node rank (SLURM_NODEID) and node 0's address (the first host",
        "# of SLURM_JOB_NODELIST) from Slurm; the rendezvous port comes from the job id unless MASTER_PORT is set.",
        *([] if live else ["# A node that fails ends the others' tasks (--kill-on-bad-exit=1): they would wait."]),
        *(["# A live run (--nnodes MIN:MAX): the others go on without a node whose task ends; a worker that",
           "# fails is replaced on its node (--max-restarts); a requeue resumes the run from its checkpoint."]
          if live else []),
        'srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-$SLURM_CPUS_ON_NODE}"'
        + (" --kill-on-bad-exit=0" if live else " --kill-on-bad-exit=1") + " \\",
        f"    {shlex.join(train)}",
    ]
    return "\n".join(lines) + "\n"


def pytorchjob_manifest(spec: JobSpec) -> str:
    """Two YAML documents: the ConfigMap holding the config, then the PyTorchJob."""
    yaml = require("yaml", "cluster", "shoal launch --target kubernetes")
    config_name = Path(spec.config).name
    run_dir = f"{RUNS_DIR}/{spec.stem}"
    resources: dict = {}
    if spec.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": spec.gpus_per_node}
    if spec.cpus_per_node:
        resources["requests"] = {"cpu": spec.cpus_per_node}

    def replica(count: int) -> dict:
        runs = {"persistentVolumeClaim": {"claimName": spec.pvc}} if spec.pvc else {"emptyDir": {}}
        volumes = [{"name": "config", "configMap": {"name": f"{spec.name}-config"}}, {"name": "runs", **runs}]
        mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                  {"name": "runs", "mountPath": RUNS_DIR}]
        if spec.nproc > 1:  # a container's /dev/shm is 64 MiB; NCCL and gloo pass tensors through it on one node
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        container = {"name": "pytorch", "image": spec.image,
                     "command": spec.train_argv(f"{CONFIG_DIR}/{config_name}", run_dir),
                     "ports": [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}],
                     "volumeMounts": mounts, **({"resources": resources} if resources else {})}
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container], "volumes": volumes}}}

    replicas = {"Master": replica(1), **({"Worker": replica(spec.nodes - 1)} if spec.nodes > 1 else {})}
    elastic = {}
    if spec.min_nodes is not None:  # Workers only: the operator's rendezvous host is <job>-worker-0
        replicas = {"Worker": replica(spec.nodes)}
        elastic = {"elasticPolicy": {"minReplicas": spec.min_nodes, "maxReplicas": spec.nodes, "rdzvBackend": "c10d",
                                     "nProcPerNode": spec.nproc}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{spec.name}-config"},
                  "data": {config_name: spec.config_text}}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": spec.name},
           "spec": {"nprocPerNode": str(spec.nproc), **elastic, "pytorchReplicaSpecs": replicas}}
    return _manifest_header(spec) + yaml.dump_all([config_map, job], Dumper=_dumper(yaml), sort_keys=False)


def _manifest_header(spec: JobSpec) -> str:
    pods = f"{spec.min_nodes}:{spec.nodes}" if spec.min_nodes is not None else str(spec.nodes)
    return (f"# {spec.config} on {pods} pod(s) x {spec.nproc} worker(s), written by `shoal launch --target "
            f"kubernetes`.\n# kubectl apply -f THIS_FILE (needs the Kubeflow training operator). Each pod's shoal "
            f"reads its node rank\n# and the master's address from the operator's variables (PET_NNODES, "
            f"PET_NODE_RANK or RANK, MASTER_ADDR; an elastic job: PET_RDZV_ENDPOINT and the pod's name).\n")


def _dumper(yaml):
    """PyYAML's safe dumper, writing multi-line strings (the config) as literal blocks, as written."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # each pod spec written out whole, no &anchors
            return True

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return Dumper


SAGEMAKER = '''"""{config} on SageMaker: {nodes} instance(s) x {nproc} worker(s).

Written by `shoal launch --target sagemaker`.

    python THIS_FILE   submits the training job (needs the SageMaker Python SDK v2, pip install
                       'sagemaker>=2.200,<3', and AWS credentials; SAGEMAKER_ROLE names the IAM role,
                       else sagemaker.get_execution_role() is asked)

SageMaker then runs this same file as the entry point on every instance: it starts `shoal train`,
which reads SM_HOSTS and SM_CURRENT_HOST for the node count, its node rank and node 0's address, and
copies the run's results to SM_MODEL_DIR. The image must hold shoal (built FROM a SageMaker PyTorch
training image, so that it runs entry points); the config travels beside this file in source_dir.
"""

import os
import shutil
import subprocess
import sys
import tempfile

CONFIG = {config!r}  # as given to shoal launch: relative to where you submit from
SHIPPED_CONFIG = {shipped!r}  # its name in source_dir, the job's working directory
IMAGE_URI = {image!r}
INSTANCE_TYPE = {instance_type!r}
INSTANCE_COUNT = {nodes}
RUN_DIR = {run_dir!r}
TRAIN = {train!r}
# e.g. "s3://my-bucket/shoal/{stem}": SageMaker copies RUN_DIR's folder there and back, so a restarted
# (or spot) job resumes from the newest checkpoint
CHECKPOINT_S3_URI = None


def train_here() -> int:
    code = subprocess.call(TRAIN)
    model_dir = os.environ.get("SM_MODEL_DIR", "/opt/ml/model")
    for name in ("model.safetensors", "summary.json", "config.toml", "metrics.jsonl"):
        if os.path.exists(os.path.join(RUN_DIR, name)):  # on the instance that held global rank 0
            shutil.copy(os.path.join(RUN_DIR, name), model_dir)
    return code


def submit() -> int:
    import sagemaker
    try:
        from sagemaker.pytorch import PyTorch
    except ImportError:  # SDK v3 (sagemaker 3.x) has no framework estimators: its ModelTrainer replaces them
        sys.exit("this script submits a SageMaker Python SDK v2 estimator (sagemaker.pytorch.PyTorch), which "
                 "SDK v3 no longer has: pip install 'sagemaker>=2.200,<3'")

    source_dir = tempfile.mkdtemp(prefix="shoal-sagemaker-")
    shutil.copy(os.path.abspath(__file__), source_dir)
    shutil.copy(CONFIG, os.path.join(source_dir, SHIPPED_CONFIG))
    estimator = PyTorch(
        entry_point=os.path.basename(__file__),
        source_dir=source_dir,
        role=os.environ.get("SAGEMAKER_ROLE") or sagemaker.get_execution_role(),
        image_uri=IMAGE_URI,
        instance_count=INSTANCE_COUNT,
        instance_type=INSTANCE_TYPE,
        base_job_name={name!r},
        checkpoint_s3_uri=CHECKPOINT_S3_URI,
    )
    estimator.fit()
    return 0


if __name__ == "__main__":
    sys.exit(train_here() if "SM_CURRENT_HOST" in os.environ else submit())
'''


def sagemaker_script(spec: JobSpec) -> str:
    shipped = Path(spec.config).name
    run_dir = f"{SAGEMAKER_RUNS}/{spec.stem}"
    return SAGEMAKER.format(config=spec.config, shipped=shipped, image=spec.image, instance_type=spec.instance_type,
                            nodes=spec.nodes, nproc=spec.nproc, run_dir=run_dir, stem=spec.stem, name=spec.name,
                            train=spec.train_argv(shipped, run_dir))

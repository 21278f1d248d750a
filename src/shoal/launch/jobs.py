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
  sagemaker   a Python script that submits a training job with the SageMaker Python SDK v3's ModelTrainer
              (instance_count N) and is also its entry script: on each instance it runs `shoal train`,
              which reads SM_HOSTS; the config travels beside it in the job's source_dir

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
from shoal.launch.cloud_jobs import VERTEX_MACHINE, azureml_job, literal_dumper, vertex_job
from shoal.layout import check_live, resolve_layout

TARGETS = ("slurm", "kubernetes", "sagemaker", "azureml", "vertex")
SAGEMAKER_INSTANCE = "ml.g5.xlarge"
CONFIG_DIR = "/etc/shoal"  # where a PyTorchJob's pods see the config (the ConfigMap's mount)
RUNS_DIR = "/runs"  # a PyTorchJob's run dirs (its volume)
MASTER_PORT = 23456  # the PyTorchJob operator's default port; it sets MASTER_PORT from the named container port
SAGEMAKER_RUNS = "/opt/ml/checkpoints"  # SageMaker copies it to and from the checkpoint S3 URI when one is given


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
    instance_type: str | None = None  # SageMaker's instance type, Vertex AI's machine type (None: a default)
    pvc: str | None = None
    min_nodes: int | None = None  # a range min_nodes:nodes (an elastic PyTorchJob); None: exactly `nodes`
    compute: str | None = None  # Azure ML's compute cluster
    accelerator: str | None = None  # Vertex AI's accelerator type, with gpus_per_node
    output: str | None = None  # Vertex AI's base output directory, gs://...
    env: tuple[tuple[str, str], ...] = ()  # variables every node's shoal starts with (NCCL's network settings)

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
    if spec.target != "slurm" and not spec.image:
        raise UserError(f"--target {spec.target} needs --image IMAGE: a container image with shoal installed "
                        f"(and the data the config reads)")
    if spec.pvc and spec.target != "kubernetes":
        raise UserError("--pvc names a Kubernetes PersistentVolumeClaim; it is for --target kubernetes")
    if spec.min_nodes is not None and spec.target in ("sagemaker", "azureml", "vertex"):
        service = {"sagemaker": "SageMaker", "azureml": "Azure ML", "vertex": "Vertex AI"}[spec.target]
        raise UserError(f"--nodes {spec.min_nodes}:{spec.nodes}: a {service} job's instance count is fixed when it "
                        f"is submitted: give --nodes N (a range is for --target slurm or kubernetes)")
    check_cloud_flags(spec)
    cfg = load_config(spec.config, list(spec.sets))
    cuda = spec.gpus_per_node > 0 or (spec.target == "sagemaker" and instance_type(spec).startswith(("ml.p", "ml.g")))
    if spec.min_nodes is not None:  # every world the range allows, and a layout that heals live
        check_live(cfg, (spec.min_nodes, spec.nodes), spec.nproc)
    for nodes in range(spec.min_nodes or spec.nodes, spec.nodes + 1):
        resolve_layout(cfg, nodes * spec.nproc, cuda)  # its UserError names the keys and a value that works


def check_cloud_flags(spec: JobSpec) -> None:
    """The flags only some targets take, each where it belongs."""
    if spec.target == "azureml" and not spec.compute:
        raise UserError("--target azureml needs --compute NAME: the Azure ML compute cluster to run on")
    if spec.compute and spec.target != "azureml":
        raise UserError("--compute names an Azure ML compute cluster; it is for --target azureml")
    if spec.target == "vertex" and spec.gpus_per_node and not spec.accelerator:
        raise UserError("--target vertex with --gpus-per-node needs --accelerator TYPE (Vertex AI's accelerator "
                        "type, e.g. NVIDIA_L4)")
    if spec.accelerator and spec.target != "vertex":
        raise UserError("--accelerator is Vertex AI's accelerator type; it is for --target vertex")
    if spec.output and (spec.target != "vertex" or not spec.output.startswith("gs://")):
        raise UserError(f"--output {spec.output}: a Vertex AI base output directory, gs://BUCKET/PATH, "
                        "for --target vertex")
    if spec.instance_type and spec.target not in ("sagemaker", "vertex"):
        raise UserError("--instance-type is a SageMaker instance type or a Vertex AI machine type; it is for "
                        "--target sagemaker or vertex")


def instance_type(spec: JobSpec) -> str:
    return spec.instance_type or {"sagemaker": SAGEMAKER_INSTANCE, "vertex": VERTEX_MACHINE}.get(spec.target, "")


def render(spec: JobSpec, out_dir: Path = Path(".")) -> str:
    """The job file's text; `out_dir`: where it is written (an Azure ML job's code path is relative to it)."""
    if spec.target == "azureml":
        return azureml_job(spec, out_dir)
    return {"slurm": sbatch_script, "kubernetes": pytorchjob_manifest, "sagemaker": sagemaker_script,
            "vertex": vertex_job}[spec.target](spec)


def default_out(spec: JobSpec) -> Path:
    return Path({"slurm": f"{spec.stem}.sbatch", "kubernetes": f"{spec.stem}-pytorchjob.yaml",
                 "sagemaker": f"{spec.stem}_sagemaker.py", "azureml": f"{spec.stem}-azureml.yaml",
                 "vertex": f"{spec.stem}-vertex.yaml"}[spec.target])


def how_to_run(spec: JobSpec, out: str) -> str:
    """What the user does with the file, and how the config travels with the job."""
    if spec.target == "slurm":
        return (f"submit it with `sbatch {out}` from this directory: every node reads {spec.config} here (a "
                f"filesystem all nodes see), and the same script resumes after a requeue")
    if spec.target == "kubernetes":
        return (f"start it with `kubectl apply -f {out}`: the config travels in the ConfigMap {spec.name}-config "
                f"(mounted at {CONFIG_DIR}); the image {spec.image} must hold shoal and the data the config reads")
    if spec.target == "azureml":
        return (f"submit it with `az ml job create --file {out}`: the config's folder is uploaded as the job's code, "
                f"and the image {spec.image} must hold shoal")
    if spec.target == "vertex":
        where = (f"the run dir under {spec.output}/checkpoints" if spec.output else
                 "no --output given, so the run dir stays in the containers")
        return (f"submit it with `gcloud ai custom-jobs create --region=REGION --display-name={spec.stem} "
                f"--config={out}`: the config travels in the spec; {where}")
    return (f"submit it with `python {out}` (the SageMaker Python SDK v3 and AWS credentials; SAGEMAKER_ROLE names the "
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
        *(["# NCCL's network, as given to shoal launch (docs/your-cluster.md, NCCL on several nodes)"]
          + [f"export {k}={shlex.quote(v)}" for k, v in spec.env] if spec.env else []),
        *(["# A live run (--nnodes MIN:MAX): the others go on without a node whose task ends; a worker that",
           "# fails is replaced on its node (--max-restarts); a requeue resumes the run from its checkpoint."]
          if live else []),
        'srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-$SLURM_CPUS_ON_NODE}"'
        + (" --kill-on-bad-exit=0" if live else " --kill-on-bad-exit=1") + " \\",
        *([f"    --container-image={shlex.quote(spec.image)} " + '--container-mounts="$PWD:$PWD" '
           '--container-workdir="$PWD" \\'] if spec.image else []),
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
                     **({"env": [{"name": k, "value": v} for k, v in spec.env]} if spec.env else {}),
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
    return _manifest_header(spec) + yaml.dump_all([config_map, job], Dumper=literal_dumper(yaml), sort_keys=False)


def _manifest_header(spec: JobSpec) -> str:
    pods = f"{spec.min_nodes}:{spec.nodes}" if spec.min_nodes is not None else str(spec.nodes)
    return (f"# {spec.config} on {pods} pod(s) x {spec.nproc} worker(s), written by `shoal launch --target "
            f"kubernetes`.\n# kubectl apply -f THIS_FILE (needs the Kubeflow training operator). Each pod's shoal "
            f"reads its node rank\n# and the master's address from the operator's variables (PET_NNODES, "
            f"PET_NODE_RANK or RANK, MASTER_ADDR; an elastic job: PET_RDZV_ENDPOINT and the pod's name).\n")


SAGEMAKER = '''"""{config} on SageMaker: {nodes} instance(s) x {nproc} worker(s).

Written by `shoal launch --target sagemaker`.

    python THIS_FILE   submits the training job (needs the SageMaker Python SDK v3, pip install
                       'sagemaker>=3', and AWS credentials; SAGEMAKER_ROLE names the IAM role, else the
                       SDK finds the default one)

SageMaker then runs this same file on every instance (ModelTrainer's script driver, in source_dir):
it starts `shoal train`, which reads SM_HOSTS and SM_CURRENT_HOST for the node count, its node rank
and node 0's address, and copies the run's results to SM_MODEL_DIR. The image needs bash, python3
and shoal (ModelTrainer runs its own driver scripts in it); the config travels beside this file.
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
ENV = {env!r}  # NCCL's network settings given to shoal launch, on every instance
# e.g. "s3://my-bucket/shoal/{stem}": SageMaker copies RUN_DIR's folder there and back, so a restarted
# (or spot) job resumes from the newest checkpoint
CHECKPOINT_S3_URI = None


def train_here() -> int:
    code = subprocess.call(TRAIN, env={{**os.environ, **ENV}})
    model_dir = os.environ.get("SM_MODEL_DIR", "/opt/ml/model")
    for name in ("model.safetensors", "summary.json", "config.toml", "metrics.jsonl"):
        if os.path.exists(os.path.join(RUN_DIR, name)):  # on the instance that held global rank 0
            shutil.copy(os.path.join(RUN_DIR, name), model_dir)
    return code


def submit() -> int:
    try:
        from sagemaker.train import ModelTrainer
        from sagemaker.train.configs import CheckpointConfig, Compute, SourceCode
    except ImportError:  # SDK v2 (sagemaker 2.x) submitted framework estimators instead
        sys.exit("this script submits with the SageMaker Python SDK v3 (sagemaker.train.ModelTrainer): "
                 "pip install 'sagemaker>=3'")

    source_dir = tempfile.mkdtemp(prefix="shoal-sagemaker-")
    shutil.copy(os.path.abspath(__file__), source_dir)
    shutil.copy(CONFIG, os.path.join(source_dir, SHIPPED_CONFIG))
    trainer = ModelTrainer(
        training_image=IMAGE_URI,
        role=os.environ.get("SAGEMAKER_ROLE"),
        base_job_name={name!r},
        source_code=SourceCode(source_dir=source_dir, entry_script=os.path.basename(__file__)),
        compute=Compute(instance_type=INSTANCE_TYPE, instance_count=INSTANCE_COUNT),
        checkpoint_config=(CheckpointConfig(s3_uri=CHECKPOINT_S3_URI, local_path={runs!r})
                           if CHECKPOINT_S3_URI else None),
    )
    trainer.train(wait=True)
    return 0


if __name__ == "__main__":
    sys.exit(train_here() if "SM_CURRENT_HOST" in os.environ else submit())
'''


def sagemaker_script(spec: JobSpec) -> str:
    shipped = Path(spec.config).name
    run_dir = f"{SAGEMAKER_RUNS}/{spec.stem}"
    return SAGEMAKER.format(config=spec.config, shipped=shipped, image=spec.image, instance_type=instance_type(spec),
                            nodes=spec.nodes, nproc=spec.nproc, run_dir=run_dir, stem=spec.stem, name=spec.name,
                            train=spec.train_argv(shipped, run_dir), runs=SAGEMAKER_RUNS, env=dict(spec.env))

"""`shoal launch` for the clouds' training services that take a YAML job spec (launch/jobs.py has the rest):

  azureml  an Azure ML command job: `resources.instance_count` N instances of the compute cluster, the
           PyTorch distribution with one process per instance (Azure ML then sets WORLD_SIZE, NODE_RANK and
           MASTER_ADDR / MASTER_PORT on each: launch/environment.py), which is `shoal train --nproc M`; the
           config's folder is the job's `code`, uploaded at submission and its working directory; the run
           dir under ./outputs, which Azure ML keeps with the job
  vertex   a Vertex AI CustomJob spec: worker pool 0 the primary replica (node 0), worker pool 1 the other
           N-1 (Vertex AI sets CLUSTER_SPEC on each); the config travels in the spec, as an environment
           variable the container's command writes to a file; the run dir under the job's base output
           directory (Cloud Storage, mounted at /gcs) when one is given
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from shoal.errors import require

AZUREML_SCHEMA = "https://azuremlschemas.azureedge.net/latest/commandJob.schema.json"
VERTEX_MACHINE = "n1-standard-8"  # a machine type every Vertex AI region offers
CONFIG_ENV = "SHOAL_CONFIG"  # a Vertex AI container's copy of the config's text


def azureml_job(spec, out_dir: Path) -> str:
    """The command job's YAML; `code` is the config's folder relative to `out_dir`, where the file is
    written (Azure ML resolves it from the file's own folder)."""
    yaml = require("yaml", "cluster", "shoal launch --target azureml")
    code = os.path.relpath(Path(spec.config).resolve().parent, out_dir.resolve())
    job = {"$schema": AZUREML_SCHEMA, "type": "command", "display_name": spec.stem, "experiment_name": "shoal",
           "code": code, "command": shlex.join(spec.train_argv(Path(spec.config).name, f"./outputs/{spec.stem}")),
           "environment": {"image": spec.image}, "compute": f"azureml:{spec.compute}",
           "resources": {"instance_count": spec.nodes},
           **({"environment_variables": dict(spec.env)} if spec.env else {}),
           # shoal starts the --nproc workers of each node itself
           "distribution": {"type": "pytorch", "process_count_per_instance": 1}}
    header = (f"# {spec.config} on {spec.nodes} instance(s) x {spec.nproc} worker(s), written by `shoal launch "
              f"--target azureml`.\n# az ml job create --file THIS_FILE (the ml extension of the Azure CLI), or "
              f"azure.ai.ml's load_job and MLClient.jobs.create_or_update.\n")
    return header + yaml.safe_dump(job, sort_keys=False)


def vertex_job(spec) -> str:
    """The CustomJobSpec's YAML (gcloud ai custom-jobs create --config takes it)."""
    yaml = require("yaml", "cluster", "shoal launch --target vertex")
    config = f"/tmp/{Path(spec.config).name}"
    argv = spec.train_argv(config, "RUN_DIR")
    at = argv.index("RUN_DIR")
    train = " ".join([shlex.join(argv[:at]), f'"${{out%/}}/{spec.stem}"', shlex.join(argv[at + 1:])])
    # the job's checkpoint dir (gs://BUCKET/...; Vertex AI mounts Cloud Storage at /gcs), else the container's own
    script = (f'printf "%s" "${CONFIG_ENV}" > {shlex.quote(config)}\n'
              'out="${AIP_CHECKPOINT_DIR:-/tmp/shoal-runs}"; out="${out/#gs:\\/\\//\\/gcs\\/}"\n'
              f"exec {train.strip()}\n")
    machine = {"machineType": spec.instance_type or VERTEX_MACHINE}
    if spec.gpus_per_node:
        machine.update(acceleratorType=spec.accelerator, acceleratorCount=spec.gpus_per_node)
    container = {"imageUri": spec.image, "command": ["bash", "-c", script],
                 "env": [{"name": CONFIG_ENV, "value": spec.config_text},
                         *[{"name": k, "value": v} for k, v in spec.env]]}
    pools = [{"machineSpec": machine, "replicaCount": count, "containerSpec": container}
             for count in (1, spec.nodes - 1) if count]
    job: dict = {"workerPoolSpecs": pools}
    if spec.output:  # Vertex AI then sets AIP_CHECKPOINT_DIR to its checkpoints/ folder
        job["baseOutputDirectory"] = {"outputUriPrefix": spec.output}
    header = (f"# {spec.config} on {spec.nodes} replica(s) x {spec.nproc} worker(s), written by `shoal launch "
              f"--target vertex`.\n# gcloud ai custom-jobs create --region=REGION --display-name={spec.stem} "
              f"--config=THIS_FILE\n")
    return header + yaml.dump(job, Dumper=literal_dumper(yaml), sort_keys=False)


def literal_dumper(yaml):
    """PyYAML's safe dumper, writing multi-line strings (a config, a script) as literal blocks, as written."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # each pod or pool spec written out whole, no &anchors
            return True

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return Dumper

"""`shoal launch --target azureml | vertex` (launch/cloud_jobs.py): each job file is what its service's own
schema accepts (Azure ML: the azure-ai-ml SDK's load_job, which validates offline; Vertex AI: the REST
API's CustomJobSpec, tests/fixtures/vertex), fails it when a required field goes, and starts `shoal
train` with the config on every node."""

import json
import os
import shlex
import stat
import subprocess
import warnings

import jsonschema
import pytest
import yaml
from jsonschema.exceptions import best_match

from conftest import FIXTURES
from shoal.cli import main

CONFIG = """[model]
name = "gpt"
n_layer = 2

[train]
global_batch_size = 16
micro_batch_size = 4
"""


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "my-job.toml").write_text(CONFIG)
    return "configs/my-job.toml"


def launch(*args) -> int:
    return main(["launch", *map(str, args)])


def load_azureml(path):
    """The job as azure-ai-ml's load_job reads it: its marshmallow schema refuses unknown fields and
    missing required ones, with no Azure account."""
    with warnings.catch_warnings():  # its experimental-class notices
        warnings.simplefilter("ignore")
        from azure.ai.ml import load_job

        return load_job(path)


def test_an_azureml_command_job_loads_in_the_sdk_and_runs_shoal_on_each_instance(config, tmp_path):
    assert launch("--target", "azureml", config, "--nodes", 2, "--nproc", 2, "--image", "acr.io/shoal:1",
                  "--compute", "gpu-cluster", "--set", "train.steps=7") == 0
    job = load_azureml("my-job-azureml.yaml")
    assert type(job).__name__ == "Command" and job.compute == "gpu-cluster" and job.resources.instance_count == 2
    assert job.distribution.process_count_per_instance == 1  # shoal starts the workers: one process per instance
    assert job.environment.image == "acr.io/shoal:1"
    assert os.path.samefile(job.code, tmp_path / "configs")  # uploaded (from the file's folder); the command runs in it
    assert shlex.split(job.command) == ["shoal", "train", "my-job.toml", "--nproc", "2", "--run-dir",
                                        "./outputs/my-job", "--set", "train.steps=7"]

    # written elsewhere (--out), the code path still finds the config's folder
    (tmp_path / "jobs").mkdir()
    assert launch("--target", "azureml", config, "--nodes", 2, "--image", "i", "--compute", "c",
                  "--out", "jobs/j.yaml") == 0
    assert os.path.samefile(tmp_path / "jobs" / load_azureml("jobs/j.yaml").code, tmp_path / "configs")

    # the SDK's check can fail: a required field removed, a misspelled one
    text = yaml.safe_load(open("my-job-azureml.yaml"))
    for broken, says in [({k: v for k, v in text.items() if k != "command"}, "command"),
                         ({**text, "resources": {"instance_cont": 2}}, "instance_cont")]:
        (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
        with pytest.raises(Exception, match=says):
            load_azureml(tmp_path / "broken.yaml")


def vertex_errors(spec: dict) -> list[str]:
    """What the REST API's CustomJobSpec (tests/fixtures/vertex) refuses in `spec`."""
    schema = json.loads((FIXTURES / "vertex" / "custom_job_spec.schema.json").read_text())
    found = (best_match([e]) for e in jsonschema.Draft202012Validator(schema).iter_errors(spec))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in found]


def test_a_vertex_custom_job_spec_fits_the_api_s_schema(config):
    assert launch("--target", "vertex", config, "--nodes", 3, "--nproc", 2, "--image", "gcr.io/p/shoal:1",
                  "--gpus-per-node", 2, "--accelerator", "NVIDIA_L4", "--instance-type", "g2-standard-24",
                  "--output", "gs://bucket/shoal", "--set", "train.global_batch_size=24") == 0
    spec = yaml.safe_load(open("my-job-vertex.yaml"))
    assert vertex_errors(spec) == []
    primary, others = spec["workerPoolSpecs"]
    assert (primary["replicaCount"], others["replicaCount"]) == (1, 2)  # pool 0 is node 0 (CLUSTER_SPEC)
    assert primary["machineSpec"] == {"machineType": "g2-standard-24", "acceleratorType": "NVIDIA_L4",
                                      "acceleratorCount": 2}
    assert spec["baseOutputDirectory"] == {"outputUriPrefix": "gs://bucket/shoal"}

    # the schema can fail: a required field removed, a misspelled one, an accelerator Vertex AI has not
    container = primary["containerSpec"]
    del container["imageUri"]
    assert vertex_errors(spec) == ["workerPoolSpecs/0/containerSpec: 'imageUri' is a required property"]
    container["imageUri"], container["imageUrl"] = "x", "x"
    assert vertex_errors(spec) == [
        "workerPoolSpecs/0/containerSpec: Additional properties are not allowed ('imageUrl' was unexpected)"]
    del container["imageUrl"]
    primary["machineSpec"]["acceleratorType"] = "NVIDIA_L5"
    assert len(vertex_errors(spec)) == 1 and "NVIDIA_L5" in vertex_errors(spec)[0]


def test_a_vertex_replica_writes_the_config_and_trains_in_the_job_s_output(config, tmp_path):
    """The container's command, run here with a stand-in `shoal` on PATH that records what it is given."""
    assert launch("--target", "vertex", config, "--nodes", 2, "--nproc", 2, "--image", "i",
                  "--set", "train.steps=7") == 0
    container = yaml.safe_load(open("my-job-vertex.yaml"))["workerPoolSpecs"][1]["containerSpec"]
    env = {e["name"]: e["value"] for e in container["env"]}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "shoal"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\ncp "$2" {tmp_path}/config\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    for checkpoints, run_dir in [("gs://bucket/shoal/checkpoints/", "/gcs/bucket/shoal/checkpoints/my-job"),
                                 (None, "/tmp/shoal-runs/my-job")]:
        extra = {"AIP_CHECKPOINT_DIR": checkpoints} if checkpoints else {}
        subprocess.run(container["command"], check=True,
                       env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **env, **extra})
        argv = (tmp_path / "argv").read_text().splitlines()
        assert argv == ["train", "/tmp/my-job.toml", "--nproc", "2", "--run-dir", run_dir, "--set", "train.steps=7"]
        assert (tmp_path / "config").read_text() == CONFIG


@pytest.mark.parametrize("args, message", [
    (["--target", "azureml", "--image", "i"], "--target azureml needs --compute NAME"),
    (["--target", "vertex", "--image", "i", "--compute", "c"], "--compute names an Azure ML compute cluster"),
    (["--target", "vertex", "--image", "i", "--gpus-per-node", 1], "--target vertex with --gpus-per-node needs --accelerator"),
    (["--target", "vertex", "--image", "i", "--output", "/data"], "--output /data: a Vertex AI base output directory"),
    (["--target", "azureml", "--compute", "c"], "--target azureml needs --image IMAGE"),
    (["--target", "azureml", "--image", "i", "--compute", "c", "--instance-type", "x"], "--instance-type is a SageMaker"),
    (["--target", "vertex", "--image", "i", "--nodes", "1:2"], "--nodes 1:2: a Vertex AI job's instance count is fixed"),
])
def test_bad_input_is_one_line_and_exit_2(config, capsys, args, message):
    nodes = [] if "--nodes" in args else ["--nodes", 2]
    assert launch(config, *nodes, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: " + message) and err.count("\n") == 1, err

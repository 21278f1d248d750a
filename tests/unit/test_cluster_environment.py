"""A scheduler's environment gives `shoal train` its nodes, node rank and rendezvous (flags win), and a
PyTorchJob pod's RANK / WORLD_SIZE never make shoal think it is a worker (launch/environment.py)."""

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from conftest import FIXTURES
from shoal import dist
from shoal.errors import UserError
from shoal.launch import environment
from shoal.launch.environment import NodeArgs, detect, expand_nodelist, node_args

NO_FLAGS = (None, None, None, None)

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_NUM_NODES": "4",
         "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-08,10],cpu3",
         "SLURM_STEP_NODELIST": "gpu[07-08,10],cpu3"}


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch):
    """The node lists are expanded here, as on a machine without Slurm (a test below brings a scontrol)."""
    monkeypatch.setattr(environment.shutil, "which", lambda name: None)


def test_slurm_gives_nodes_node_rank_and_the_first_host_on_a_port_from_the_job_id():
    args, line = node_args(*NO_FLAGS, env=SLURM)
    assert args == NodeArgs("4", 2, "gpu07:24242", 1)
    assert line == "shoal: from Slurm (job 4242): 4 nodes, node rank 2, rendezvous gpu07:24242"
    # every node of the step derives the same port; another step of the job, another port
    assert environment.slurm_port("4242", "0") == 24242 and environment.slurm_port("4242", "1") == 24243


def test_slurm_master_addr_and_port_win_over_the_node_list_and_gpus_suggest_nproc():
    env = {**SLURM, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555", "SLURM_GPUS_ON_NODE": "8"}
    args, line = node_args(*NO_FLAGS, env=env)
    assert args == NodeArgs("4", 2, "10.1.2.3:29555", 8)
    assert line.endswith("rendezvous 10.1.2.3:29555, 8 workers per node (SLURM_GPUS_ON_NODE)")


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("x,y[9-10],n[008-010]", ["x", "y9", "y10", "n008", "n009", "n010"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_slurm_node_lists_expand_as_scontrol_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_scontrol_expands_the_node_list_where_slurm_is_installed(monkeypatch, tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "first-of-%s\\nsecond\\n" "$3"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(environment.shutil, "which", lambda name: str(fake) if name == "scontrol" else None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert expand_nodelist("n[1-2]") == ["first-of-n[1-2]", "second"]


@pytest.mark.parametrize("env, expected", [
    ({k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS")},
     "inside Slurm job 4242 of 4 nodes, but not in an srun step: start one shoal per node with `srun "
     "--ntasks-per-node=1 shoal train ...`"),
    ({**SLURM, "SLURM_STEP_NUM_TASKS": "16"}, "srun started 16 tasks on 4 nodes (SLURM_STEP_NUM_TASKS): shoal wants "
                                              "one per node"),
    ({**SLURM, "SLURM_NODEID": "4"}, "SLURM_NODEID=4 must be below the job's 4 nodes (SLURM_STEP_NUM_NODES)"),
    ({**SLURM, "SLURM_STEP_NODELIST": "gpu[07-"}, "the Slurm node list 'gpu[07-' has unbalanced brackets"),
    ({**SLURM, "SLURM_STEP_NUM_NODES": "four"}, "SLURM_STEP_NUM_NODES='four': expected a whole number"),
])
def test_slurm_mistakes_are_one_line_naming_the_fix(env, expected):
    with pytest.raises(UserError) as e:
        node_args(*NO_FLAGS, env=env)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_batch_script_may_train_on_its_own_node_when_told():
    batch = {k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES",
                                                        "SLURM_STEP_NUM_TASKS")}
    assert node_args("1", None, None, None, env=batch) == (NodeArgs("1", 0, None, 1), None)


PYTORCHJOB_POD = {"MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1"}


def test_a_pytorchjob_pods_rank_and_world_size_are_the_nodes_not_a_worker(monkeypatch):
    """The older operator sets the four torch.distributed variables for the pod (WORLD_SIZE pods, RANK the
    pod's index): shoal is that node's launcher, not a worker."""
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in PYTORCHJOB_POD.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_launched()
    args, line = node_args(*NO_FLAGS, env=os.environ)
    assert args == NodeArgs("3", 1, "train-master-0:23456", 1)
    assert line == ("shoal: from torchrun variables (WORLD_SIZE, RANK, MASTER_ADDR): 3 nodes, node rank 1, "
                    "rendezvous train-master-0:23456")


def test_a_torch_elastic_worker_is_a_worker(monkeypatch):
    """What torch 2.13's agent (ours, torchrun's) sets for each worker: LOCAL_RANK among the rest."""
    worker = {**PYTORCHJOB_POD, "LOCAL_RANK": "0", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1",
              "TORCHELASTIC_RUN_ID": "shoal-x"}
    for k, v in worker.items():
        monkeypatch.setenv(k, v)
    assert dist.is_launched()


def test_the_newer_operators_pet_variables_win_over_its_world_size():
    """With nprocPerNode the operator sets WORLD_SIZE = pods x nprocPerNode; PET_NNODES is the node count."""
    env = {**PYTORCHJOB_POD, "WORLD_SIZE": "8", "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4"}
    args, line = node_args(*NO_FLAGS, env=env)
    assert args == NodeArgs("2", 1, "train-master-0:23456", 4)
    assert line == ("shoal: from torchrun variables (PET_*): 2 nodes, node rank 1, rendezvous train-master-0:23456, "
                    "4 workers per node (PET_NPROC_PER_NODE)")


def test_trainer_v2_pet_master_address_and_nproc_auto():
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "auto",
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
    assert node_args(*NO_FLAGS, env=env)[0] == NodeArgs("2", 0, "job-node-0-0.job:29400", 1)  # no GPU: not taken
    assert node_args(*NO_FLAGS, env=env, gpus=8)[0].nproc == 8  # torchrun's auto: one worker per GPU


# what the Kubeflow training operator sets in a pod of a PyTorchJob named "train" with an elasticPolicy
# (minReplicas 1, maxReplicas 3, nProcPerNode 2; pkg/controller.v1/pytorch/elastic.go): no node rank
ELASTIC_POD = {"PET_RDZV_ENDPOINT": "train-worker-0:23456", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "1:3",
               "PET_N_PROC_PER_NODE": "2", "PYTHONUNBUFFERED": "0"}


@pytest.mark.parametrize("pod, rank", [("train-worker-0", 0), ("train-worker-2", 2)])
def test_an_elastic_pytorchjob_pod_takes_its_rank_from_its_name(pod, rank):
    args, line = node_args(*NO_FLAGS, env={**ELASTIC_POD, "HOSTNAME": pod})
    assert args == NodeArgs("1:3", rank, "train-worker-0:23456", 2)
    assert line == (f"shoal: from torchrun variables (PET_*): 1:3 nodes, node rank {rank}, rendezvous "
                    f"train-worker-0:23456, 2 workers per node (PET_N_PROC_PER_NODE)")
    # PET_NODE_RANK, where something sets it, wins
    assert node_args(*NO_FLAGS, env={**ELASTIC_POD, "HOSTNAME": pod, "PET_NODE_RANK": "1"})[0].node_rank == 1


@pytest.mark.parametrize("env, expected", [
    ({**ELASTIC_POD, "HOSTNAME": "laptop"}, "PET_NNODES=1:3 gives no node rank, and this pod's hostname (laptop) is "
                                            "not <name>-<index> beside the rendezvous host train-worker-0"),
    ({**ELASTIC_POD, "PET_RDZV_ENDPOINT": "store:23456", "HOSTNAME": "train-worker-1"},
     "PET_NNODES=1:3 gives no node rank, and this pod's hostname (train-worker-1) is not <name>-<index> beside"),
    ({"PET_NNODES": "1:3", "HOSTNAME": "train-worker-1"}, "PET_NNODES=1:3 but no PET_RDZV_ENDPOINT says where"),
])
def test_an_elastic_pod_without_a_rank_is_one_line(env, expected):
    with pytest.raises(UserError, match="^" + re.escape(expected)):
        node_args(*NO_FLAGS, env=env)
    assert node_args("1:3", 1, "h:1", 1, env=env)[0] == NodeArgs("1:3", 1, "h:1", 1)  # flags need nothing of it


def test_sagemaker_sorts_the_hosts_and_the_first_is_node_0():
    env = {"SM_HOSTS": '["algo-2", "algo-1"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "4"}
    args, line = node_args(*NO_FLAGS, env=env)
    assert args == NodeArgs("2", 1, "algo-1:29400", 4)
    assert line == "shoal: from SageMaker: 2 nodes, node rank 1, rendezvous algo-1:29400, 4 workers per node (SM_NUM_GPUS)"
    with pytest.raises(UserError, match="SM_CURRENT_HOST='algo-9' is not one of SM_HOSTS"):
        detect({**env, "SM_CURRENT_HOST": "algo-9"})


def test_a_sagemaker_instance_reads_what_the_sdk_s_own_driver_writes(tmp_path):
    """SageMaker Python SDK v3's ModelTrainer ships scripts/environment.py to every instance, which writes the
    SM_* variables the entry script then runs with (tests/fixtures/sagemaker, unchanged, 3.27.0): run it for
    the second instance of a two-instance job, source what it wrote as its train script does, and read."""
    drivers = FIXTURES / "sagemaker" / "container_drivers"
    resource = {"current_host": "algo-2", "current_instance_type": "ml.g5.12xlarge", "current_group_name": "homogeneousCluster",
                "hosts": ["algo-2", "algo-1"], "network_interface_name": "eth0"}
    written = tmp_path / "sm_training.env"
    subprocess.run([sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); import environment; "
                    "environment.set_env(json.loads(sys.argv[2]), {}, {}, output_file=sys.argv[3])",
                    str(drivers / "scripts"), json.dumps(resource), str(written)],
                   check=True, capture_output=True, env={**os.environ, "TRAINING_JOB_NAME": "my-job"})
    shell = subprocess.run(["bash", "-c", f"set -a; source {written}; env -0"], check=True, capture_output=True,
                           env={"PATH": os.environ["PATH"]}).stdout.decode()
    env = dict(line.split("=", 1) for line in shell.split("\0") if "=" in line)
    assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"] and env["SM_CURRENT_HOST"] == "algo-2"
    args, line = node_args(*NO_FLAGS, env=env)
    assert args == NodeArgs("2", 1, "algo-1:29400", 1)  # no GPU here (SM_NUM_GPUS=0): one worker, as --nproc says
    assert line.startswith("shoal: from SageMaker: 2 nodes, node rank 1, rendezvous algo-1:29400")


AZUREML = {"AZUREML_RUN_ID": "shoal_1700000000_ab12", "NODE_RANK": "1", "RANK": "1", "LOCAL_RANK": "0",
           "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105"}


def test_an_azureml_node_is_a_node_not_a_worker(monkeypatch):
    """Azure ML's PyTorch distribution sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT and
    NODE_RANK for the process it starts on each instance (one, as `shoal launch --target azureml` asks)."""
    args, line = node_args(*NO_FLAGS, env=AZUREML)
    assert args == NodeArgs("2", 1, "10.0.0.4:6105", 1)
    assert line == "shoal: from Azure ML (run shoal_1700000000_ab12): 2 nodes, node rank 1, rendezvous 10.0.0.4:6105"
    monkeypatch.setattr(os, "environ", dict(AZUREML))
    assert not dist.is_launched()  # the node: it starts the workers
    monkeypatch.setattr(os, "environ", {**AZUREML, "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1"})
    assert dist.is_launched()  # a worker the node's launcher started, its variables inherited
    with pytest.raises(UserError, match=r"^Azure ML started several processes per instance \(LOCAL_RANK=3, "):
        detect({**AZUREML, "LOCAL_RANK": "3", "RANK": "7"})
    with pytest.raises(UserError, match="several processes per instance"):  # node 1's first of 4: RANK 4
        detect({**AZUREML, "RANK": "4", "WORLD_SIZE": "8"})


def cluster_spec(kind: str, index: int) -> str:
    """CLUSTER_SPEC as Vertex AI sets it for a replica of a job of 1 + 2 replicas."""
    return json.dumps({"cluster": {"workerpool0": ["cmle-training-workerpool0-0:2222"],
                                   "workerpool1": ["cmle-training-workerpool1-0:2222", "cmle-training-workerpool1-1:2222"]},
                       "environment": "cloud", "task": {"type": kind, "index": index}})


def test_vertex_ai_s_worker_pools_are_the_nodes_the_primary_replica_node_0():
    args, line = node_args(*NO_FLAGS, env={"CLUSTER_SPEC": cluster_spec("workerpool1", 1)})
    assert args == NodeArgs("3", 2, "cmle-training-workerpool0-0:29400", 1)
    assert line == "shoal: from Vertex AI (CLUSTER_SPEC): 3 nodes, node rank 2, rendezvous cmle-training-workerpool0-0:29400"
    assert detect({"CLUSTER_SPEC": cluster_spec("workerpool0", 0)}).node_rank == 0
    # Vertex's PyTorch images also set torchrun's four per node: CLUSTER_SPEC is read first, and they agree
    assert detect({"CLUSTER_SPEC": cluster_spec("workerpool1", 0), "RANK": "1", "WORLD_SIZE": "3",
                   "MASTER_ADDR": "cmle-training-workerpool0-0", "MASTER_PORT": "3333"}).endpoint \
        == "cmle-training-workerpool0-0:3333"
    with pytest.raises(UserError, match="^this replica is in Vertex AI's workerpool2: shoal trains on worker pools 0"):
        detect({"CLUSTER_SPEC": cluster_spec("workerpool2", 0)})
    with pytest.raises(UserError, match="^CLUSTER_SPEC='{oops' is not Vertex AI's cluster spec"):
        detect({"CLUSTER_SPEC": "{oops"})


def test_flags_win_field_by_field():
    args, line = node_args(None, 0, "10.0.0.1:29400", 2, env=SLURM)
    assert args == NodeArgs("4", 0, "10.0.0.1:29400", 2)
    assert line == "shoal: from Slurm (job 4242): 4 nodes"
    assert node_args("2", 1, "10.0.0.1:29400", 2, env=SLURM) == (NodeArgs("2", 1, "10.0.0.1:29400", 2), None)
    assert node_args(None, None, None, 0, env=SLURM)[0].nproc == 0  # given, so kept (and refused in one line later)


def test_no_scheduler_leaves_the_defaults():
    assert node_args(*NO_FLAGS, env={"HOME": "/root"}) == (NodeArgs("1", 0, None, 1), None)
    assert detect({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}).endpoint is None


def test_a_node_range_in_a_slurm_step_waits_for_the_nodes_slurm_started():
    """`--nnodes 1:4` (a live run) inside a step Slurm started on 4 nodes: node rank and rendezvous from Slurm,
    and the first generation waits for all 4 (membership.START_CALL_S), not just the first to arrive."""
    args, line = node_args("1:4", None, None, None, env=SLURM)
    assert args == NodeArgs("1:4", 2, "gpu07:24242", 1, started=4)
    assert line == "shoal: from Slurm (job 4242): node rank 2, rendezvous gpu07:24242"
    one = {**SLURM, "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
           "SLURM_NODEID": "0"}
    assert node_args("1:4", None, None, None, env=one)[0] == NodeArgs("1:4", 0, "gpu07:24242", 1, started=1)


def test_a_heterogeneous_jobs_step_reads_as_one_job():
    """The variables Slurm 22.05 set in the second component's task of `srun --het-group=0,1` (measured):
    the step's count and node ids run over both components."""
    het = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_HET_SIZE": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1", "SLURM_JOB_NUM_NODES_HET_GROUP_1": "1",
           "SLURM_JOB_NODELIST": "h[0-1]", "SLURM_JOB_NODELIST_HET_GROUP_0": "h0",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "h1", "SLURM_STEP_NODELIST": "h[0-1]", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURMD_NODENAME": "h1"}
    assert node_args(*NO_FLAGS, env=het)[0] == NodeArgs("2", 1, "h0:20001", 1)


def test_a_node_name_no_resolver_knows_becomes_slurms_node_addr(monkeypatch, tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $4" = "show node --oneliner" ] && '
                    'echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.200.0.1 NodeHostName=$3"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(environment.shutil, "which", lambda name: str(fake) if name == "scontrol" else None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert environment.node_address("h0.invalid") == "10.200.0.1"  # .invalid never resolves (RFC 2606)
    assert environment.node_address("localhost") == "localhost"

"""What a scheduler's environment says about this node: the number of nodes, this node's rank, node 0's
rendezvous endpoint and (where the scheduler knows it) how many workers to start here.

`shoal train` reads it when a flag does not say otherwise (flags win, field by field):

  Slurm       srun with one task per node: SLURM_STEP_NUM_NODES (or SLURM_JOB_NUM_NODES / SLURM_NNODES),
              SLURM_NODEID, and the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST /
              SLURM_NODELIST, expanded by `scontrol show hostnames` where it exists, else parsed here;
              a name that does not resolve is replaced by the NodeAddr `scontrol show node` gives);
              MASTER_ADDR / MASTER_PORT where set, else a port derived from the job's id, so every node
              computes the same one. A heterogeneous job's step over several components (srun
              --het-group=0,1) reads the same: Slurm 22.05 sets the step's variables over all of them
              (SLURM_STEP_NUM_NODES their sum, SLURM_NODEID counted across them), measured
  torchrun    a Kubeflow PyTorchJob pod, or anything that sets torchrun's own variables: PET_NNODES,
              PET_NODE_RANK, PET_RDZV_ENDPOINT or PET_MASTER_ADDR / PET_MASTER_PORT, PET_NPROC_PER_NODE;
              else the pod-level WORLD_SIZE (nodes), RANK (node rank), MASTER_ADDR and MASTER_PORT
  SageMaker   SM_HOSTS (a JSON list) and SM_CURRENT_HOST: the hosts sorted, the first is node 0; SM_NUM_GPUS
  Azure ML    a command job with the PyTorch distribution and one process per instance (AZUREML_RUN_ID):
              WORLD_SIZE (then the nodes), NODE_RANK, MASTER_ADDR and MASTER_PORT, set on each node; the
              RANK and LOCAL_RANK it also sets per process do not make shoal a worker (dist.is_launched)
  Vertex AI   a CustomJob's CLUSTER_SPEC (JSON: "cluster" {workerpool0: [host:port], workerpool1: [...]},
              "task" {type, index}): the hosts of worker pools 0 (the primary replica) and 1, in order;
              node 0's host on port 29400 (its listed port is for TensorFlow) unless MASTER_PORT

[Note: pod or worker] RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT mean two things. The torch elastic
agent (ours, torchrun's) sets them for each *worker process*, with LOCAL_RANK; Kubeflow's older
PyTorchJob operator sets the same four for the *pod* (WORLD_SIZE = pods, RANK = pod index, meant for
torchrun's --nnodes / --node_rank) and never LOCAL_RANK; the newer one sets WORLD_SIZE = pods x
nprocPerNode beside PET_NNODES and PET_NODE_RANK. So a process is a worker only when LOCAL_RANK is
set too (shoal.dist.is_launched); the others are read here, PET_* first. Azure ML's PyTorch distribution
sets all five and NODE_RANK for each process it starts: with one per instance that process is the node
(dist.azureml_node), unless a launcher's variables say it is a worker started on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.dist import azureml_node
from shoal.errors import UserError

DEFAULT_PORT = 29400  # torch elastic's c10d rendezvous port, where the environment names none
SLURM_PORTS = (20000, 10000)  # first port, count: a Slurm job's port is first + job id mod count


@dataclass(frozen=True)
class Found:
    """What one environment says; None where it says nothing."""

    source: str  # "Slurm (job 4242)", for the line printed at start
    nnodes: int | str | None = None  # a str: a range, MIN:MAX
    node_rank: int | None = None
    endpoint: str | None = None
    nproc: int | None = None
    nproc_from: str = ""  # the variable nproc came from
    refusal: str | None = None  # why its node count cannot be used as it is (raised only if it is taken)


@dataclass(frozen=True)
class NodeArgs:
    """`shoal train`'s node arguments once flags and environment are merged."""

    nnodes: str  # as --nnodes takes it
    node_rank: int
    rdzv_endpoint: str | None
    nproc: int
    started: int | None = None  # a range's nodes the scheduler started together (a Slurm step), where known


def node_args(nnodes: str | None, node_rank: int | None, rdzv_endpoint: str | None, nproc: int | None,
              env: Mapping[str, str] = os.environ, gpus: int = 0,
              default_nproc: int = 1) -> tuple[NodeArgs, str | None]:
    """The flags given (None where not), completed from the environment; and the line saying what was
    taken from where (None when nothing was). `gpus`: CUDA devices here (PET_NPROC_PER_NODE=auto);
    `default_nproc`: the workers where neither the flag nor the environment says."""

    started = None

    def completed() -> NodeArgs:  # the values as they stand when called; a flag given as 0 stays 0 (refused later)
        return NodeArgs("1" if nnodes is None else nnodes, 0 if node_rank is None else node_rank, rdzv_endpoint,
                        default_nproc if nproc is None else nproc, started)

    if nproc is not None and (nnodes == "1" or None not in (nnodes, node_rank, rdzv_endpoint)):
        return completed(), None  # nothing left to take
    found = detect(env, gpus)
    if found is None:
        return completed(), None
    taken = []
    if nnodes is None and found.refusal:
        raise UserError(found.refusal)
    if nnodes is None and found.nnodes is not None:
        nnodes = str(found.nnodes)
        taken.append(f"{found.nnodes} node{'s' if found.nnodes != 1 else ''}")
    several = int(nnodes) > 1 if nnodes and nnodes.isdigit() else True
    if ":" in (nnodes or "") and isinstance(found.nnodes, int):
        started = found.nnodes  # a range given, and the scheduler started so many nodes (a Slurm step)
    if several and node_rank is None and found.node_rank is not None:
        node_rank = found.node_rank
        taken.append(f"node rank {node_rank}")
    if several and rdzv_endpoint is None and found.endpoint is not None:
        rdzv_endpoint = found.endpoint
        taken.append(f"rendezvous {rdzv_endpoint}")
    if nproc is None and found.nproc is not None:
        nproc = found.nproc
        taken.append(f"{nproc} worker{'s' if nproc != 1 else ''} per node ({found.nproc_from})")
    return completed(), (f"shoal: from {found.source}: {', '.join(taken)}" if taken else None)


def detect(env: Mapping[str, str] = os.environ, gpus: int = 0) -> Found | None:
    """The first environment that says something: torchrun's variables (set for this very process by a
    launcher), then Azure ML and Vertex AI (whose nodes get torchrun's four too), Slurm, SageMaker. Called
    outside a worker ([Note: pod or worker])."""
    if "PET_NNODES" in env:
        return torchrun(env, gpus)
    if azureml_node(env):
        return azureml(env)
    if "CLUSTER_SPEC" in env:
        return vertex(env)
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return torchrun(env, gpus)
    if "SLURM_JOB_ID" in env and any(k in env for k in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES",
                                                        "SLURM_NNODES")):
        return slurm(env)
    if "SM_HOSTS" in env and "SM_CURRENT_HOST" in env:
        return sagemaker(env)
    return None


def torchrun(env: Mapping[str, str], gpus: int = 0) -> Found:
    """torchrun's variables for a node: PET_* (torchrun reads PET_<FLAG> as --<flag>), else the four a
    PyTorchJob pod gets (WORLD_SIZE pods, RANK its index)."""
    pet = "PET_NNODES" in env
    source = "torchrun variables (PET_*)" if pet else "torchrun variables (WORLD_SIZE, RANK, MASTER_ADDR)"
    if pet and ":" in env["PET_NNODES"]:
        return elastic_pod(env, source, gpus)
    nodes_key = "PET_NNODES" if pet else "WORLD_SIZE"
    rank_key = next((k for k in ("PET_NODE_RANK", "RANK") if k in env), None)
    nnodes = _int(env, nodes_key, low=1)
    node_rank = _int(env, rank_key, low=0) if rank_key else 0 if nnodes == 1 else None
    if node_rank is None:
        raise UserError(f"{nodes_key}={nnodes} but neither PET_NODE_RANK nor RANK says this node's rank; set one "
                        f"or pass --node-rank")
    if node_rank >= nnodes:
        raise UserError(f"{rank_key}={node_rank} must be below the {nnodes} nodes of {nodes_key}")
    endpoint = env.get("PET_RDZV_ENDPOINT")
    if not endpoint:
        host = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
        port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or str(DEFAULT_PORT)
        endpoint = f"{host}:{port}" if host else None
    return Found(source, nnodes, node_rank, endpoint, *_nproc(env, gpus))


def _nproc(env: Mapping[str, str], gpus: int) -> tuple[int | None, str]:
    """Workers per node from torchrun's variable (the operator's elasticPolicy writes PET_N_PROC_PER_NODE)."""
    key = next((k for k in ("PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE") if k in env), "PET_NPROC_PER_NODE")
    per_node = env.get(key, "")
    if per_node.isdigit() and int(per_node) >= 1:
        return int(per_node), key
    if per_node in ("auto", "gpu") and gpus > 0:  # torchrun's meaning: one worker per GPU
        return gpus, f"{key}={per_node}: the GPUs here"
    return None, ""


def elastic_pod(env: Mapping[str, str], source: str, gpus: int) -> Found:
    """A pod of a PyTorchJob with an elasticPolicy: PET_NNODES=MIN:MAX and the rendezvous endpoint
    PET_RDZV_ENDPOINT (the operator's default host is the pod <job>-worker-0), but no node rank, since
    torch elastic's rendezvous assigns them. shoal's live run needs one: node 0 hosts its store. It is
    PET_NODE_RANK where set, else the index in this pod's hostname (the operator names the pods
    <job>-worker-<index>, and a pod's hostname is its name) beside the endpoint's <job>-worker-0."""
    nnodes, endpoint = env["PET_NNODES"], env.get("PET_RDZV_ENDPOINT")
    if not endpoint:
        return Found(source, refusal=f"PET_NNODES={nnodes} but no PET_RDZV_ENDPOINT says where node 0's store "
                                     f"is; set it (HOST:PORT of the pod that hosts it) or pass --rdzv-endpoint")
    if "PET_NODE_RANK" in env:
        node_rank = _int(env, "PET_NODE_RANK", low=0)
    else:
        host, name = endpoint.rpartition(":")[0], env.get("HOSTNAME") or socket.gethostname()
        stem = host.split(".")[0].removesuffix("-0")
        index = name.removeprefix(f"{stem}-") if host.split(".")[0].endswith("-0") else ""
        if not index.isdigit():
            return Found(source, refusal=f"PET_NNODES={nnodes} gives no node rank, and this pod's hostname "
                                         f"({name}) is not <name>-<index> beside the rendezvous host {host} "
                                         f"(<name>-0, which hosts the run's store); pass --node-rank (0 on the "
                                         f"pod at PET_RDZV_ENDPOINT)")
        node_rank = int(index)
    return Found(source, nnodes, node_rank, endpoint, *_nproc(env, gpus))


def slurm(env: Mapping[str, str]) -> Found:
    """A Slurm task: one `shoal train` per node (srun --ntasks-per-node=1), each starting its workers."""
    job = env["SLURM_JOB_ID"]
    source = f"Slurm (job {job})"
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env  # set by srun, not in the batch script itself
    key = next(k for k in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") if k in env)
    nnodes = _int(env, key, low=1)
    refusal = None
    if nnodes > 1 and not in_step:
        refusal = (f"inside Slurm job {job} of {nnodes} nodes, but not in an srun step: start one shoal per node "
                   f"with `srun --ntasks-per-node=1 shoal train ...` (or pass --nnodes 1 for this node alone)")
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if in_step and tasks.isdigit() and int(tasks) > nnodes:
        refusal = (f"srun started {tasks} tasks on {nnodes} nodes (SLURM_STEP_NUM_TASKS): shoal wants one per "
                   f"node and starts --nproc workers itself; run `srun --ntasks-per-node=1 shoal train ... "
                   f"--nproc M`")
    node_rank = _int(env, "SLURM_NODEID", low=0) if "SLURM_NODEID" in env else (0 if nnodes == 1 else None)
    if node_rank is None and refusal is None:
        refusal = f"Slurm job {job} has {nnodes} nodes but no SLURM_NODEID says which this is; pass --node-rank"
    if node_rank is not None and node_rank >= nnodes:
        raise UserError(f"SLURM_NODEID={node_rank} must be below the job's {nnodes} nodes ({key})")
    endpoint = None  # wanted on one node too by a live run (--nnodes MIN:MAX) that Slurm started on MIN = 1
    listed = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if k in env), None)
    if env.get("MASTER_ADDR") or listed:
        host = env.get("MASTER_ADDR") or node_address(first_host(env[listed]))
        port = env.get("MASTER_PORT") or str(slurm_port(job, env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))))
        endpoint = f"{host}:{port}"
    elif nnodes > 1:
        raise UserError(f"Slurm job {job}: no SLURM_JOB_NODELIST to find node 0 in; pass --rdzv-endpoint HOST:PORT")
    nproc = None
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        nproc = int(gpus)
    return Found(source, nnodes, node_rank, endpoint, nproc, "SLURM_GPUS_ON_NODE" if nproc else "", refusal)


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """Node 0's rendezvous port for a Slurm job step: every node derives the same one from the ids, and
    two steps of one job (or two jobs sharing a node) get different ones."""
    first, count = SLURM_PORTS
    job = int(job_id) if job_id.isdigit() else sum(map(ord, job_id))
    return first + (job + (int(step_id) if step_id.isdigit() else 0)) % count


def node_address(host: str) -> str:
    """`host` where it resolves; else the NodeAddr Slurm has for it (clusters that declare their nodes
    by address have names no DNS knows: srun reaches them, a rendezvous could not); else `host`."""
    if not shutil.which("scontrol"):
        return host
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    out = subprocess.run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True)
    found = re.search(r"\bNodeAddr=(\S+)", out.stdout) if out.returncode == 0 else None
    return found.group(1) if found else host


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("node[01-03,07],gpu5" -> "node01")."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise UserError(f"the Slurm node list {nodelist!r} names no host; pass --rdzv-endpoint HOST:PORT")
    return hosts[0]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm node list, in order: `scontrol show hostnames` where Slurm is installed,
    else the same expansion here (comma-separated names, each with any number of [a-b,c] ranges,
    zero padding kept)."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    return [host for item in _split_outside_brackets(nodelist) for host in _expand_item(item)]


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise UserError(f"the Slurm node list {text!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise UserError(f"the Slurm node list {text!r} has unbalanced brackets")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_item(item: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest) if rest else [""]
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UserError(f"the Slurm node list range [{ranges}] in {item!r} is not of the form [1-3,7]")
        width = len(lo)
        out += [f"{prefix}{n:0{width}d}{tail}" for n in range(int(lo), int(hi or lo) + 1) for tail in tails]
    return out


def sagemaker(env: Mapping[str, str]) -> Found:
    """A SageMaker training job: SM_HOSTS sorted, the first hosts the rendezvous; one worker per GPU."""
    try:
        hosts = sorted(json.loads(env["SM_HOSTS"]))
    except (ValueError, TypeError):
        raise UserError(f"SM_HOSTS={env['SM_HOSTS']!r} is not a JSON list of host names") from None
    current = env["SM_CURRENT_HOST"]
    if current not in hosts:
        raise UserError(f"SM_CURRENT_HOST={current!r} is not one of SM_HOSTS {hosts}")
    port = env.get("MASTER_PORT") or str(DEFAULT_PORT)
    gpus = env.get("SM_NUM_GPUS", "")
    nproc = int(gpus) if gpus.isdigit() and int(gpus) > 0 else None
    return Found("SageMaker", len(hosts), hosts.index(current), f"{hosts[0]}:{port}" if len(hosts) > 1 else None,
                 nproc, "SM_NUM_GPUS" if nproc else "")


def azureml(env: Mapping[str, str]) -> Found:
    """An Azure ML command job (distribution: pytorch): shoal starts the workers, so one process per
    instance, whose WORLD_SIZE is then the number of nodes."""
    local, rank, node = env.get("LOCAL_RANK", "0"), env.get("RANK"), env.get("NODE_RANK")
    if local != "0" or (rank is not None and rank != node):
        raise UserError(f"Azure ML started several processes per instance (LOCAL_RANK={local}, RANK={rank}, "
                        f"NODE_RANK={node}): set distribution.process_count_per_instance: 1 and give shoal --nproc, "
                        "as `shoal launch --target azureml` writes")
    nnodes, node_rank = _int(env, "WORLD_SIZE", low=1), _int(env, "NODE_RANK", low=0)
    if node_rank >= nnodes:
        raise UserError(f"NODE_RANK={node_rank} must be below WORLD_SIZE={nnodes}")
    host = env.get("MASTER_ADDR")
    endpoint = f"{host}:{env.get('MASTER_PORT') or DEFAULT_PORT}" if host and nnodes > 1 else None
    return Found(f"Azure ML (run {env['AZUREML_RUN_ID']})", nnodes, node_rank, endpoint)


def vertex(env: Mapping[str, str]) -> Found:
    """A Vertex AI CustomJob: worker pool 0 (its one primary replica) is node 0, worker pool 1's replicas
    the others; pools 2 and 3 (parameter servers, evaluators) take no part."""
    try:
        spec = json.loads(env["CLUSTER_SPEC"])
        pools, task = spec["cluster"], spec["task"]
        kind, index = task["type"], int(task["index"])
        hosts = list(pools.get("workerpool0", [])) + list(pools.get("workerpool1", []))
    except (ValueError, TypeError, KeyError):
        raise UserError(f"CLUSTER_SPEC={env['CLUSTER_SPEC']!r} is not Vertex AI's cluster spec (JSON with "
                        '"cluster" and "task": {"type", "index"})') from None
    if kind not in ("workerpool0", "workerpool1") or not hosts:
        raise UserError(f"this replica is in Vertex AI's {kind}: shoal trains on worker pools 0 and 1 only; "
                        "leave pools 2 and 3 (parameter servers, evaluators) out of the job")
    node_rank = index + (len(pools.get("workerpool0", [])) if kind == "workerpool1" else 0)
    if node_rank >= len(hosts):
        raise UserError(f"CLUSTER_SPEC's task {kind} {index} is not among its {len(hosts)} hosts")
    host = hosts[0].rsplit(":", 1)[0]
    endpoint = f"{host}:{env.get('MASTER_PORT') or DEFAULT_PORT}" if len(hosts) > 1 else None
    return Found("Vertex AI (CLUSTER_SPEC)", len(hosts), node_rank, endpoint)


def _int(env: Mapping[str, str], key: str, low: int) -> int:
    try:
        value = int(env[key])
    except ValueError:
        raise UserError(f"{key}={env[key]!r}: expected a whole number") from None
    if value < low:
        raise UserError(f"{key}={value} must be >= {low}")
    return value

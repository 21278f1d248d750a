"""A multi-host cluster on one machine: network namespaces joined by a bridge, each host's link
rate-limited with tc and its processes capped by a cgroup, and `shoal train` run on it as one node
agent per host (the same --nnodes/--node-rank/--rdzv-endpoint path as on real machines).

system.py runs `ip`/`tc` and checks for root; shape.py parses and applies the limits (tbf, netem,
cgroup cpu quota); hosts.py makes, lists and removes the cluster and keeps its state file; run.py
starts the node agents.

Real clusters: environment.py reads the nodes, node rank and rendezvous a scheduler gives (Slurm, a
Kubeflow PyTorchJob or torchrun's variables, SageMaker); jobs.py writes `shoal launch`'s job files.
"""

"""A multi-host cluster on one machine, for testing what crosses a network (root): network namespaces
joined by a bridge, each host's link rate-limited with tc and its processes capped by a cgroup, and a
command (`shoal train` as one node agent per host, on the same --nnodes/--node-rank/--rdzv-endpoint path
as on real machines) run on every host. `shoal cluster up | down | status | run`.

system.py runs `ip`/`tc` and checks for root; shape.py parses and applies the limits (tbf, netem,
cgroup cpu quota); hosts.py makes, lists and removes the cluster and keeps its state file; run.py runs
a command on every host under the launcher's supervisor.
"""

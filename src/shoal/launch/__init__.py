"""Starting and watching processes, and where a job's nodes come from.

forkserver.py   the server the workers are forked from, started as `shoal train` begins
restart.py      workers through torch elastic's agent (the machinery behind torchrun): one node or
                several, each node named by its address on the route to the rendezvous; on a failure every
                worker restarts from the newest checkpoint (live/node.py: the other elasticity, which goes on
                without a restart)
supervisor.py   the one supervisor of several process trees run as one job (the asynchronous parameter
                server's roles, the testbed's hosts): signals passed on, a failure stops the rest, the
                worst exit code wins
environment.py  the nodes, node rank and rendezvous a scheduler gives (Slurm, a Kubeflow PyTorchJob or
                torchrun's variables, SageMaker); `shoal train` reads it when a flag does not say
jobs.py         `shoal launch`: the sbatch script, PyTorchJob manifest or SageMaker script for a config
"""

# the command that continues this run, which the launcher puts in its workers' environment (worker.py says it
# when a run fails); here, where nothing imports torch, as the launcher sets it before the early fork server
# starts ([Note: early fork server] in forkserver.py)
RESUME_COMMAND = "SHOAL_RESUME_COMMAND"

"""The parameter server (sync.mode = "parameter-server", [ps]), all of it.

Servers hold the parameters and their optimizer state, sharded by whole tensors (shards.py); workers
train with the model whole and push gradients to the servers, which step and send back the new
parameters. Two modes:
  sync   every step, every worker (one job; ranks): the same training as every-step data parallelism
  async  each worker's update applied on arrival, a unit of data dealt with each reply; workers come and
         go (links.py: a gloo group per server-worker pair), the servers save and resume alone

What is where:
  messages.py      every message kind and the typed headers, replies and accounts on the wire
  wire.py          how a server's tensors travel: dense, or embedding tables by rows
  links.py         the asynchronous mode's server-worker links, and workers' registration
  shards.py        which server owns which tensor; a server's shard and its optimizer
  worker.py        the synchronous worker: PushPull (its StepSync), RemoteOptimizer, ServedModel
  async_worker.py  the asynchronous worker: AsyncPushPull, and DealtUnits (the feed of its loop)
  strategies.py    SyncWorker / AsyncWorker: what the training run does differently for a worker
  sync_server.py   a synchronous server's loop
  async_server.py  an asynchronous server: one method per event; server 0 deals the units
  checkpoints.py   asynchronous servers' own checkpoints, at clean cuts
  run.py           a rank's part: serve, or train through training/run.py with a worker's strategy
  roles.py         the asynchronous roles as separate elastic jobs, so that workers can come and go
"""

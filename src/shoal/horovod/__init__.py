"""Horovod's PyTorch API on torch.distributed: `import shoal.horovod as hvd` where a script says
`import horovod.torch as hvd`, and under `shoal run --horovod` that very line (alias.py), unchanged.

What is where (docs/horovod.md says what maps to what, and what is refused):
  runtime.py          init / shutdown, size / rank / local / cross, what is built
  ops.py              Average, Sum, Min, Max, Product (Adasum refused); the scale factors
  handles.py          the handles of *_async operations: synchronize, poll; HorovodInternalError
  reduce.py           allreduce and reducescatter: in-place and asynchronous forms
  gather.py           allgather (uneven first dimension), broadcast, alltoall (uneven splits), barrier
  differentiable.py   the plain forms, differentiable as Horovod's
  functions.py        broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object
  compression.py      Compression.none / fp16 (Horovod's), int8 / topk / powersgd (shoal's codecs)
  optimizer.py        DistributedOptimizer: synchronize, skip_synchronize, backward_passes_per_step
  exchange.py         its gradient buckets, sent while backward goes on
  join.py             join: a process out of data takes part in the others' steps
  sync_batch_norm.py  SyncBatchNorm, CPU included
  process_sets.py     the global process set (the only one)
  elastic/            hvd.elastic: run, TorchState, ElasticSampler on shoal's restarts
  alias.py            `import horovod` resolved to this package for one process
Every collective goes through comm/ (comm/user_ops.py), logged for the hang report.
"""

from shoal.horovod import elastic
from shoal.horovod.compression import Compression
from shoal.horovod.differentiable import (
                                          allgather,
                                          allreduce,
                                          alltoall,
                                          broadcast,
                                          grouped_allgather,
                                          grouped_allreduce,
                                          grouped_reducescatter,
                                          reducescatter,
)
from shoal.horovod.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from shoal.horovod.gather import (
                                          allgather_async,
                                          alltoall_async,
                                          barrier,
                                          broadcast_,
                                          broadcast_async,
                                          broadcast_async_,
                                          grouped_allgather_async,
)
from shoal.horovod.handles import HorovodInternalError, poll, synchronize
from shoal.horovod.join import join
from shoal.horovod.ops import Adasum, Average, Max, Min, Product, Sum
from shoal.horovod.optimizer import DistributedOptimizer
from shoal.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from shoal.horovod.reduce import (
                                          allreduce_,
                                          allreduce_async,
                                          allreduce_async_,
                                          grouped_allreduce_,
                                          grouped_allreduce_async,
                                          grouped_allreduce_async_,
                                          grouped_reducescatter_async,
                                          reducescatter_async,
)
from shoal.horovod.runtime import (
                                          ccl_built,
                                          cross_rank,
                                          cross_size,
                                          cuda_built,
                                          ddl_built,
                                          gloo_built,
                                          gloo_enabled,
                                          init,
                                          is_homogeneous,
                                          is_initialized,
                                          local_rank,
                                          local_size,
                                          mpi_built,
                                          mpi_enabled,
                                          mpi_threads_supported,
                                          nccl_built,
                                          rank,
                                          rocm_built,
                                          shutdown,
                                          size,
)
from shoal.horovod.sync_batch_norm import SyncBatchNorm

__version__ = "0.28.1"  # the Horovod release whose API this follows (horovod/torch, 0.28.1)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "Product",
    "ProcessSet", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "synchronize",
]

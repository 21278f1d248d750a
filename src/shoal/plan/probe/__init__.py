"""`shoal probe`: measure what this machine and its network can do, and write the hardware profile
(hardware.py) that `shoal plan` and MFU read.

One worker per process of the group, started through shoal's own launcher (launch/restart.py; `--cluster`:
one node per host of the one-machine cluster, testbed/nodes.py). Each worker measures
  - matmul FLOP/s per dtype over square sizes (the curve, and its best as the peak),
  - memory bandwidth (a large copy: bytes read + written per second),
  - reference training steps of the built-in GPT (reference_steps): each operator timed by operator
    and size, what a step pays per operator besides its arithmetic, and (CPU) what freshly mapped
    memory costs per byte under ZeRO 2/3's allocator setting,
  - what DTensor, DDP, a tensor-parallel layer and FSDP2 cost per operator, call, parameter tensor,
    layer or byte (parallel_overheads),
  - its resident memory after importing the training stack (what every worker holds before a model),
  - on a GPU, its memory beyond the tensors: the caching allocator's reserve over its allocated peak in the
    reference steps, the CUDA context's bytes before any collective and what NCCL's communicator adds,
and the group measures all-reduce, all-gather, reduce-scatter and point-to-point (rank pairs 2i <->
2i+1) over message sizes, issued through comm/ (each one recorded). A time is the median over the
repetitions of the slowest rank's time (a collective ends when its last rank does). How much of each it
measures depends on the device (plan/reference.py: a GPU's matmuls, copy and reference GPT are larger).

Its modules, one job each:
  compute.py      matmul FLOP/s per dtype over square sizes, and a large copy's bandwidth
  steps.py        the reference GPT's training steps timed operator by operator (OpTimer), the overhead a step
                  pays per operator, a CPU's heap and fresh-memory costs; the profile's fields from them
  wrappers.py     what DTensor, DDP, a tensor-parallel layer and FSDP2 cost (parallel_overheads, fsdp_costs)
  collectives.py  the group's collective curves over message sizes (collective_curves; a GPU's with the CUDA
                  context's and NCCL's bytes: gpu_collectives)
  gpu_memory.py   a GPU's memory beyond its tensors: the allocator's reserve, what lies outside the allocator
  measure.py      the worker: every part above in order, the profile written with its summary line; the
                  calibration added after, and the launcher that starts the workers (launch_probe)
"""

from shoal.plan.probe.collectives import COLLECTIVES, collective_curves, gpu_collectives, sizes_up_to
from shoal.plan.probe.gpu_memory import outside_bytes
from shoal.plan.probe.measure import calibrate_profile, launch_probe, measure, store_barrier, summary_line, worker
from shoal.plan.probe.steps import StepCosts, _reference_bundle, reference_steps, step_fields

# what other code (the CLI, plan's profiles, the tests) imports from the package
__all__ = ["COLLECTIVES", "StepCosts", "_reference_bundle", "calibrate_profile", "collective_curves", "gpu_collectives",
           "launch_probe", "measure", "outside_bytes", "reference_steps", "sizes_up_to", "step_fields", "store_barrier",
           "summary_line", "worker"]

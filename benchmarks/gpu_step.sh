#!/usr/bin/env bash
# benchmarks/gpu_step.py on a GPU machine without shoal's dependencies (the wheels in .whl/): gpu_run.sh says how.
#   bash benchmarks/gpu_step.sh [gpu_step.py's arguments, e.g. --fp8]
exec bash "$(dirname "$0")/gpu_run.sh" gpu_step "$@"

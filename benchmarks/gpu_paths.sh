#!/usr/bin/env bash
# benchmarks/gpu_paths.py on a GPU machine without shoal's dependencies (the wheels in .whl/): gpu_run.sh says how.
#   bash benchmarks/gpu_paths.sh [gpu_paths.py's arguments, e.g. --only train-fp16,export]
exec bash "$(dirname "$0")/gpu_run.sh" gpu_paths "$@"

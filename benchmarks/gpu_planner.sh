#!/usr/bin/env bash
# benchmarks/gpu_planner.py on a GPU machine without shoal's dependencies (the wheels in .whl/): gpu_run.sh says how.
#   bash benchmarks/gpu_planner.sh [gpu_planner.py's arguments, e.g. --runs mb8,mb16]
exec bash "$(dirname "$0")/gpu_run.sh" gpu_planner "$@"

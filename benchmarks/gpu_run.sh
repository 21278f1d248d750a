#!/usr/bin/env bash
# A benchmarks/ script (gpu_paths, gpu_step or gpu_planner) on a machine whose python3 holds a CUDA torch but not
# shoal's other dependencies, with no network, in one call from the repository root:
#   bash benchmarks/gpu_run.sh NAME [NAME.py's arguments]      (gpu_paths.sh, gpu_step.sh and gpu_planner.sh call it)
# Before, where there is a network: the wheels of what it lacks (pydantic, tomli-w, ...; torchao for fp8) go in
# .whl/, which must travel with the checkout (it is ignored by git): ../shared/tools/device-wheels [torchao]. They go
# to /tmp/site, src/ onto PYTHONPATH: no virtualenv. Run dirs go to /tmp/NAME; every command's output to
# $OUT/NAME_logs where $OUT is set (the device tool's folder of files to bring back, written as the runs go), else
# to /tmp/NAME/logs.
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1
shift
site=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
elif ! python3 -c "import pydantic, tomli_w" 2> /dev/null; then
  echo "$name: no .whl/ and python3 lacks pydantic or tomli_w: put their wheels in .whl/ first" >&2
  exit 2
fi
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=/tmp/$name
logs=$out/logs
if [ -n "${OUT:-}" ]; then logs=$OUT/${name}_logs; fi
exec python3 -m "benchmarks.$name" --out "$out" --logs "$logs" "$@"

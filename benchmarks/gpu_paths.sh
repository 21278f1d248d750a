#!/usr/bin/env bash
# benchmarks/gpu_paths.py on a machine whose python3 holds a CUDA torch but not shoal's other dependencies, with
# no network, in one call from the repository root:
#   bash benchmarks/gpu_paths.sh [gpu_paths.py's arguments, e.g. --only train-fp16,export]
# Before, where there is a network: the wheels of what it lacks (pydantic, tomli-w, ...) go in .whl/, which must
# travel with the checkout (it is ignored by git). They go to /tmp/site, src/ onto PYTHONPATH: no virtualenv.
# Run dirs go to $GPU_PATHS_OUT (default /tmp/gpu_paths); every command's output to $OUT/gpu_paths_logs where $OUT
# is set (the device tool's folder of files to bring back, written as the paths run), else to $GPU_PATHS_OUT/logs.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${GPU_PATHS_SITE:-/tmp/site}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
elif ! python3 -c "import pydantic, tomli_w" 2> /dev/null; then
  echo "gpu_paths.sh: no .whl/ and python3 lacks pydantic or tomli_w: put their wheels in .whl/ first" >&2
  exit 2
fi
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${GPU_PATHS_OUT:-/tmp/gpu_paths}
logs=$out/logs
if [ -n "${OUT:-}" ]; then logs=$OUT/gpu_paths_logs; fi
exec python3 benchmarks/gpu_paths.py --out "$out" --logs "$logs" "$@"

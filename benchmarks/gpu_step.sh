#!/usr/bin/env bash
# benchmarks/gpu_step.py on a machine whose python3 holds a CUDA torch but not shoal's other dependencies, with no
# network, in one call from the repository root:
#   bash benchmarks/gpu_step.sh [gpu_step.py's arguments, e.g. --fp8]
# Before, where there is a network: the wheels of what it lacks (pydantic, tomli-w, ...; torchao for --fp8) go in
# .whl/, which must travel with the checkout (it is ignored by git): ../shared/tools/device-wheels [torchao]. They go
# to /tmp/site, src/ onto PYTHONPATH: no virtualenv. Run dirs go to $GPU_STEP_OUT (default /tmp/gpu_step); every
# command's output to $OUT/gpu_step_logs where $OUT is set (the device tool's folder of files to bring back; the
# figures go there too, as gpu_step.json, written as the runs go), else to $GPU_STEP_OUT/logs.
set -euo pipefail
cd "$(dirname "$0")/.."
site=${GPU_STEP_SITE:-/tmp/site}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
elif ! python3 -c "import pydantic, tomli_w" 2> /dev/null; then
  echo "gpu_step.sh: no .whl/ and python3 lacks pydantic or tomli_w: put their wheels in .whl/ first" >&2
  exit 2
fi
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${GPU_STEP_OUT:-/tmp/gpu_step}
logs=$out/logs
if [ -n "${OUT:-}" ]; then logs=$OUT/gpu_step_logs; fi
exec python3 benchmarks/gpu_step.py --out "$out" --logs "$logs" "$@"

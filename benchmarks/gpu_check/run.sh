#!/usr/bin/env bash
# The GPU check on a lent GPU machine: install the wheels carried in .whl/ (no registry there),
# then run every step. Usage: benchmarks/gpu_check/run.sh OUT_DIR [python -m benchmarks.gpu_check args]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: benchmarks/gpu_check/run.sh OUT_DIR [args]}
shift
py=${GPU_PY:-python3}
wheels=${CONVEYOR_WHEELS:-.whl}
site=${CONVEYOR_SITE:-/tmp/conveyor-site}
if compgen -G "$wheels/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl || exit 3
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
exec $py -m benchmarks.gpu_check --out "$out" "$@"
